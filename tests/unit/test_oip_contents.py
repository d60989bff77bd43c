"""The Open Inference Protocol's typed contents: read into the very bytes the raw
form carries, refused with INVALID_ARGUMENT naming the field otherwise, and bounded
by the request guard's limits as tensor values (a packed run of up to
MAX_TENSOR_VALUES entries), not as a shape's rank."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from expertd.codec import MAX_REPEATED, MAX_TENSOR_VALUES, MessageLimitError, check_limits
from expertd.server.malformed import TENSOR_VALUES
from expertd.server.oip import to_forward_request
from expertd.server.validate import RequestError
from expertd.v1 import expertd_pb2 as pb
from expertd.v1 import inference_pb2 as oip

M, K, H = 3, 4, 8
RNG = np.random.default_rng(0)
X = RNG.standard_normal((M, H)).astype(np.float32)
IDS = np.array([[0, 5, -1, 63], [2**31 - 1, -(2**31), 7, 1], [3, 3, 3, 3]], dtype=np.int64)
W = RNG.random((M, K)).astype(np.float32)
W[0, 0] = np.nextafter(np.float32(1), np.float32(0))  # a value that needs every bit


def request(typed=(), ids_type="INT32") -> oip.ModelInferRequest:
    """hidden_states raw (BF16 bytes: X's high halves), the inputs in `typed` as contents."""
    r = oip.ModelInferRequest(model_name="moe")
    r.parameters["layer"].int64_param = 0
    bf16 = (X.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    r.inputs.add(name="hidden_states", datatype="BF16", shape=[M, H])
    r.raw_input_contents.append(bf16)
    ids = IDS.astype(np.int32 if ids_type == "INT32" else np.int64)
    t = r.inputs.add(name="topk_ids", datatype=ids_type, shape=[M, K])
    if "topk_ids" in typed:
        field = t.contents.int_contents if ids_type == "INT32" else t.contents.int64_contents
        field.extend(ids.ravel().tolist())
    else:
        r.raw_input_contents.append(ids.tobytes())
    t = r.inputs.add(name="topk_weights", datatype="FP32", shape=[M, K])
    if "topk_weights" in typed:
        t.contents.fp32_contents.extend(W.ravel().tolist())
    else:
        r.raw_input_contents.append(W.tobytes())
    return r


def tensor_bytes(forward, name: str) -> tuple[int, list[int], bytes]:
    t = getattr(forward, name)
    return t.dtype, list(t.shape), bytes(t.data)


@pytest.mark.parametrize("ids_type", ["INT32", "INT64"])
def test_typed_contents_give_the_raw_bytes(ids_type):
    raw = to_forward_request(request(ids_type=ids_type))
    typed = to_forward_request(request({"topk_ids", "topk_weights"}, ids_type))
    for name in ("hidden_states", "topk_ids", "topk_weights"):
        assert tensor_bytes(typed, name) == tensor_bytes(raw, name)
    assert typed.topk_ids.dtype == (pb.INT32 if ids_type == "INT32" else pb.INT64)


def refusal(r: oip.ModelInferRequest) -> str:
    with pytest.raises(RequestError) as e:
        to_forward_request(r)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return e.value.message


def test_bf16_has_no_typed_field():
    r = request()
    r.inputs[0].contents.fp32_contents.extend(X.ravel().tolist())
    del r.raw_input_contents[0]
    message = refusal(r)
    assert message.startswith("hidden_states: datatype BF16 has no typed contents field")
    assert "raw_input_contents or shared memory" in message


def test_a_value_in_another_field_is_named():
    r = request({"topk_ids"})
    r.inputs[1].contents.uint_contents.append(1)
    message = refusal(r)
    assert "topk_ids: contents.uint_contents is set" in message
    assert "INT32 values go in contents.int_contents" in message


def test_a_count_that_does_not_fill_the_shape_is_named():
    r = request({"topk_weights"})
    r.inputs[2].contents.fp32_contents.append(0.5)
    assert (
        refusal(r) == "topk_weights: contents.fp32_contents holds 13 values, shape [3, 4] needs 12"
    )


def test_an_input_sent_two_ways_is_named():
    r = request({"topk_ids"})
    r.raw_input_contents.insert(1, IDS.astype(np.int32).tobytes())
    assert refusal(r).startswith("inputs[1] (topk_ids): both contents and a raw_input_contents")
    r = request({"topk_ids"})
    del r.raw_input_contents[:]
    message = refusal(r)
    assert "3 inputs (1 in contents) but 0 raw_input_contents" in message


def test_tensor_values_are_bounded_as_tensors_not_as_a_rank():
    n = 100 * MAX_REPEATED
    r = request()
    r.inputs[1].contents.int64_contents.extend([-1] * n)  # ten-byte varints
    r.inputs[2].contents.fp32_contents.extend([0.5] * n)
    data = r.SerializeToString()
    check_limits(data, oip.ModelInferRequest.DESCRIPTOR, TENSOR_VALUES)
    with pytest.raises(MessageLimitError, match="'int64_contents' has more than 64 entries"):
        check_limits(data, oip.ModelInferRequest.DESCRIPTOR)  # what a shape would be held to
    # A shape is held to its limit inside the same request.
    r.inputs[0].shape.extend([1] * MAX_REPEATED)
    with pytest.raises(MessageLimitError, match="'shape' has more than 64 entries"):
        check_limits(r.SerializeToString(), oip.ModelInferRequest.DESCRIPTOR, TENSOR_VALUES)


@pytest.mark.parametrize("field", ["int_contents", "fp32_contents"])
def test_tensor_values_past_the_limit_are_refused(field):
    r = oip.ModelInferRequest()
    getattr(r.inputs.add().contents, field).extend([1] * (MAX_TENSOR_VALUES + 1))
    with pytest.raises(MessageLimitError, match=f"'{field}' has more than {MAX_TENSOR_VALUES}"):
        check_limits(r.SerializeToString(), oip.ModelInferRequest.DESCRIPTOR, TENSOR_VALUES)
