"""Property-based fuzzing of every RPC's messages (hypothesis) against one real
shard server: random dtypes, shapes (huge ones with small payloads too), byte
lengths, ids, NaN/Inf, truncated bytes, unknown layers and models, and random
bytes as the serialized message.

The oracle is docs/protocol.md itself: `expected_ok` says whether a request is
well formed; a well-formed one must be answered with the reference's result, a
malformed one refused with a caller's-mistake status (never UNKNOWN or
INTERNAL), and a good request must be answered correctly after each of them.
The large-payload cases (just under the limit, over it, then a small request)
are tests/unit/test_validation.py's.
"""

from __future__ import annotations

import math

import grpc
import pytest
import torch
from conftest import PRESET, SEED
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from expertd import wire
from expertd.kernels import reference_forward, relative_error
from expertd.server.synthetic import synthetic_layer
from expertd.v1 import expertd_pb2 as pb
from expertd.v1 import expertd_pb2_grpc as pb_grpc
from expertd.v1 import inference_pb2 as oip
from expertd.v1 import inference_pb2_grpc as oip_grpc

CALLERS_MISTAKE = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
OWNED = range(8)  # shard 0 of 8
FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,  # the same examples on every CI run: a red build is reproducible
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
NAMES = ("hidden_states", "topk_ids", "topk_weights")
ALLOWED = {"hidden_states": (pb.BF16,), "topk_ids": (pb.INT32, pb.INT64)}
ALLOWED["topk_weights"] = (pb.FP32, pb.BF16)


@pytest.fixture(scope="module")
def shard_layers():
    """Shard 0's experts of each layer: the reference of its partial output."""
    return [synthetic_layer(PRESET, SEED, layer, list(OWNED)) for layer in range(2)]


@pytest.fixture(scope="module")
def channel(cluster):
    with grpc.insecure_channel(cluster[0].address) as ch:
        yield ch


# -- the requests -------------------------------------------------------------------

values = st.one_of(
    st.floats(-8, 8, width=32),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0]),
)


@st.composite
def forward_requests(draw) -> pb.ForwardRequest:
    """A well-formed request of a few tokens, then zero to three mutations."""
    m, k = draw(st.integers(0, 5)), draw(st.integers(0, 4))
    x = torch.tensor(draw(st.lists(values, min_size=m, max_size=m)) or [0.0] * m)
    x = x.unsqueeze(1).repeat(1, PRESET.hidden_size).to(torch.bfloat16)
    ids = torch.tensor(draw(st.lists(st.integers(-1, 9), min_size=m * k, max_size=m * k)))
    w = torch.tensor(draw(st.lists(values, min_size=m * k, max_size=m * k)), dtype=torch.float32)
    req = pb.ForwardRequest(
        layer=draw(st.sampled_from([0, 1, 0, 1, 2, 2**32 - 1])),
        request_id=draw(st.integers(0, 2**64 - 1)),
        hidden_states=wire.encode(x),
        topk_ids=wire.encode(ids.view(m, k).to(draw(st.sampled_from([torch.int32, torch.int64])))),
        topk_weights=wire.encode(w.view(m, k)),
    )
    for _ in range(draw(st.integers(0, 3))):
        mutate(draw, req, getattr(req, draw(st.sampled_from(NAMES))))
    return req


def mutate(draw, req: pb.ForwardRequest, t: pb.Tensor) -> None:
    kind = draw(
        st.sampled_from(["dtype", "shape", "huge", "truncate", "extend", "clear", "ids", "random"])
    )
    if kind == "dtype":
        t.dtype = draw(st.integers(0, 9))
    elif kind == "shape":
        t.ClearField("shape")
        t.shape.extend(draw(st.lists(st.integers(-3, 2**40), max_size=4)))
    elif kind == "huge":  # declared huge, 64 bytes sent
        t.ClearField("shape")
        t.shape.extend([2**40, PRESET.hidden_size])
        t.data = bytes(64)
    elif kind == "truncate":
        t.data = t.data[: draw(st.integers(0, max(len(t.data) - 1, 0)))]
    elif kind == "extend":
        t.data += draw(st.binary(min_size=1, max_size=16))
    elif kind == "clear":
        req.ClearField(draw(st.sampled_from(NAMES)))
    elif kind == "ids":
        t.CopyFrom(wire.encode(torch.tensor([[draw(st.integers(-(2**31), 2**31 - 1))]])))
    else:
        t.data = draw(st.binary(max_size=64))


def expected_ok(req: pb.ForwardRequest):
    """docs/protocol.md as a predicate: the decoded (x, ids, w) when well formed, else None."""
    if req.layer not in (0, 1) or not all(req.HasField(n) for n in NAMES):
        return None
    tensors = []
    for name in NAMES:
        t = getattr(req, name)
        if t.dtype not in ALLOWED[name] or len(t.shape) != 2:
            return None
        try:
            tensors.append(wire.decode(t, name))
        except wire.WireError:
            return None
    x, ids, w = tensors
    m, k = ids.shape
    if x.shape != (m, PRESET.hidden_size) or w.shape != ids.shape or (m and not 1 <= k <= 64):
        return None
    if ((ids < -1) | (ids >= PRESET.num_experts)).any():
        return None
    if not (torch.isfinite(x).all() and torch.isfinite(w).all()):
        return None
    return x, ids, w


def check_answer(shard_layers, req, outcome) -> None:
    """`outcome`: a ForwardResponse or a (code, details) refusal."""
    parts = expected_ok(req)
    if isinstance(outcome, tuple):
        code, details = outcome
        assert code in CALLERS_MISTAKE, f"{code.name}: {details}"
        assert parts is None, f"well-formed request refused: {code.name}: {details}"
        return
    assert parts is not None, "malformed request answered"
    x, ids, w = parts
    out = wire.decode(outcome.output, "output")
    ref = reference_forward(shard_layers[req.layer], x, ids, w)
    assert out.shape == ref.shape
    # Outputs scale with the weights: fuzzed weights of 1e-44 give a reference below
    # bf16's smallest number, which the server rightly rounds to 0.
    tiny = bool((out.double() - ref).abs().max() <= 1e-36) if ref.numel() else True
    assert relative_error(out, ref) <= 1e-2 or tiny


def good_request_works(channel, shard_layers) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((3, PRESET.hidden_size), generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 7], [3, -1], [40, 5]], dtype=torch.int32)
    w = torch.rand((3, 2), generator=gen)
    req = pb.ForwardRequest(
        layer=1,
        hidden_states=wire.encode(x),
        topk_ids=wire.encode(ids),
        topk_weights=wire.encode(w),
    )
    reply = pb_grpc.ExpertServiceStub(channel).Forward(req, timeout=10)
    check_answer(shard_layers, req, reply)


def call(fn, req):
    """-> the reply, or (code, details); tallied in hypothesis' statistics."""
    try:
        reply = fn(req, timeout=10)
    except grpc.RpcError as e:
        event(f"refused {e.code().name}")
        return e.code(), e.details()
    event("answered")
    return reply


# -- the RPCs -----------------------------------------------------------------------


@FUZZ
@given(req=forward_requests())
def test_forward(channel, shard_layers, req):
    check_answer(shard_layers, req, call(pb_grpc.ExpertServiceStub(channel).Forward, req))
    good_request_works(channel, shard_layers)


@settings(FUZZ, max_examples=60)
@given(reqs=st.lists(forward_requests(), min_size=1, max_size=6))
def test_forward_stream(channel, shard_layers, reqs):
    for i, req in enumerate(reqs):
        req.request_id = i  # answers may come in any order: match them by id
    replies = list(pb_grpc.ExpertServiceStub(channel).ForwardStream(iter(reqs), timeout=20))
    assert sorted(r.request_id for r in replies) == list(range(len(reqs)))
    for reply in replies:
        outcome = reply
        if reply.HasField("error"):
            code = next(c for c in grpc.StatusCode if c.value[0] == reply.error.code)
            outcome = (code, reply.error.message)
        check_answer(shard_layers, reqs[reply.request_id], outcome)
    good_request_works(channel, shard_layers)


OIP_TYPES = {pb.BF16: "BF16", pb.FP32: "FP32", pb.INT32: "INT32", pb.INT64: "INT64"}


@st.composite
def infer_requests(draw):
    """-> (ModelInferRequest, the ForwardRequest it means or None when it means none)."""
    fwd = draw(forward_requests())
    req = oip.ModelInferRequest(
        model_name=draw(st.sampled_from(["moe", "moe", "", "other"])),
        model_version=draw(st.sampled_from(["", "1", "2"])),
    )
    if draw(st.booleans()):
        req.parameters["layer"].int64_param = fwd.layer
    elif draw(st.booleans()):
        req.parameters["layer"].string_param = "0"
    names = [n for n in NAMES if fwd.HasField(n)]
    for name in draw(st.permutations(names)):
        t = getattr(fwd, name)
        datatype = OIP_TYPES.get(t.dtype, draw(st.sampled_from(["FP16", "BYTES", "?"])))
        req.inputs.add(name=name, datatype=datatype, shape=list(t.shape))
        req.raw_input_contents.append(t.data)
    if draw(st.integers(0, 9)) == 0:
        req.raw_input_contents.append(b"\0")  # one raw content too many
    layer = req.parameters.get("layer")
    meant = (
        req.model_name == "moe"
        and req.model_version in ("", "1")
        and len(req.raw_input_contents) == len(req.inputs)
        and layer is not None  # no layer parameter: INVALID_ARGUMENT, never layer 0
        and layer.HasField("int64_param")
        and all(t.dtype in OIP_TYPES for t in (getattr(fwd, n) for n in names))
    )
    return req, fwd if meant else None


@settings(FUZZ, max_examples=200)
@given(case=infer_requests())
def test_oip_model_infer(channel, shard_layers, case):
    req, fwd = case
    outcome = call(oip_grpc.GRPCInferenceServiceStub(channel).ModelInfer, req)
    if fwd is None:
        assert isinstance(outcome, tuple) and outcome[0] in CALLERS_MISTAKE, outcome
    else:
        if not isinstance(outcome, tuple):
            raw = outcome.raw_output_contents[0]
            shape = list(outcome.outputs[0].shape)
            outcome = pb.ForwardResponse(output=pb.Tensor(dtype=pb.BF16, shape=shape, data=raw))
        check_answer(shard_layers, fwd, outcome)
    good_request_works(channel, shard_layers)


METHODS = [
    "/expertd.v1.ExpertService/Forward",
    "/expertd.v1.ExpertService/Describe",
    "/inference.GRPCInferenceService/ModelInfer",
]


@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")  # big repr
@settings(FUZZ, max_examples=40)
@given(method=st.sampled_from(METHODS), raw=st.binary(max_size=256))
def test_random_bytes_as_the_message(channel, shard_layers, method, raw):
    rpc = channel.unary_unary(method)  # no serializers: the bytes go out as they are
    outcome = call(rpc, raw)
    assert not isinstance(outcome, tuple) or outcome[0] in CALLERS_MISTAKE, outcome
    good_request_works(channel, shard_layers)
