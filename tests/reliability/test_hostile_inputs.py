"""Hostile messages against a real `expertd serve` process, with auth on and off.

Each message is as large as the server accepts (~29 MiB for the `small` preset) and
built to be expensive to parse: millions of tiny repeated fields, a shape list of
millions of entries, thousands of nested or empty sub-messages. The server must refuse
each one promptly (UNAUTHENTICATED before reading the body when auth is on; otherwise
INVALID_ARGUMENT naming the limit the message breaks), and while such messages keep
coming, a health check and a normal Forward from another client must still answer
within about a second.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expertd import wire
from expertd.launcher import start_shard, stop_shards, wait_serving
from expertd.v1 import expertd_pb2 as pb
from expertd.v1 import expertd_pb2_grpc as pb_grpc

TOKEN = "hostile-test-token"
SIZE = 29 << 20  # just under the small preset's message limit (~30 MiB)
ATTACK_S = 6.0  # how long the hostile senders keep going
PROBE_LIMIT_S = 2.0  # a probe (health Check, normal Forward) answers within this (~0.1 s idle)
REFUSE_LIMIT_S = 5.0  # each hostile message is refused within this
FORWARD = "/expertd.v1.ExpertService/Forward"
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
DESCRIBE = "/expertd.v1.ExpertService/Describe"


def varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def hostile_messages(size: int = SIZE) -> dict[str, tuple[str, bytes]]:
    """name -> (method, serialized message of about `size` bytes)."""
    n = size - 64
    long_shape = field(2, varint(1 << 3 | 0) + b"\x01" + field(2, b"\x01" * n))
    unpacked = field(2, b"\x10\x01" * (n // 2))  # shape entries one field each
    groups = b"\x7b" * 50 + b"\x7c" * 50  # unknown field 15 as groups nested 50 deep
    infer_shape = field(5, field(1, b"hidden_states") + field(2, b"BF16") + field(3, b"\x01" * n))
    return {
        "forward: tiny repeated fields": (FORWARD, b"\x08\x01" * (n // 2)),
        "forward: long packed shape": (FORWARD, long_shape),
        "forward: long unpacked shape": (FORWARD, unpacked),
        "forward: empty sub-messages": (FORWARD, b"\x12\x00" * (n // 2)),
        "forward: unknown fields": (FORWARD, b"\xf8\x06\x01" * (n // 3)),
        "forward: nested groups": (FORWARD, groups * (n // 100)),
        "model infer: long shape": (MODEL_INFER, field(1, b"moe") + infer_shape),
        "model infer: empty inputs": (MODEL_INFER, b"\x2a\x00" * (n // 2)),
        "describe: unknown fields": (DESCRIBE, b"\xf8\x06\x01" * (n // 3)),
    }


def good_forward(channel, metadata=()) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((2, 512), generator=gen).to(torch.bfloat16)
    req = pb.ForwardRequest(
        layer=0,
        hidden_states=wire.encode(x),
        topk_ids=wire.encode(torch.tensor([[0, 7], [3, -1]], dtype=torch.int32)),
        topk_weights=wire.encode(torch.rand((2, 2), generator=gen)),
    )
    reply = pb_grpc.ExpertServiceStub(channel).Forward(req, timeout=30, metadata=metadata)
    assert list(reply.output.shape) == [2, 512]


def health_check(channel) -> None:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module", params=["auth off", "auth on"])
def server(request, tmp_path_factory):
    args = ["--synthetic", "small", "--layers", "1", "--seed", "7", "--num-shards", "8"]
    args += ["--torch-threads", "1"]
    if request.param == "auth on":
        token_file = tmp_path_factory.mktemp("auth") / "token"
        token_file.write_text(TOKEN)
        args += ["--auth-token-file", str(token_file)]
    shard = start_shard(args)
    try:
        wait_serving([shard], timeout=120)
        yield request.param, shard
    finally:
        stop_shards([shard], timeout=30)


def refuse_one(address: str, method: str, raw: bytes) -> tuple[grpc.StatusCode, str, float]:
    options = [("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(address, options=options) as channel:
        t0 = time.monotonic()
        try:
            channel.unary_unary(method)(raw, timeout=60)
        except grpc.RpcError as e:
            return e.code(), e.details() or "", time.monotonic() - t0
    raise AssertionError(f"{method}: a hostile message was answered")


def test_each_hostile_message_refused_promptly(server):
    mode, shard = server
    for name, (method, raw) in hostile_messages().items():
        code, details, took = refuse_one(shard.address, method, raw)
        assert took < REFUSE_LIMIT_S, f"{name}: refused after {took:.1f} s"
        if mode == "auth on":
            assert code == grpc.StatusCode.UNAUTHENTICATED, (name, code, details)
        else:
            assert code in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            ), (name, code, details)
            assert "limit" in details or "at most" in details, (name, details)
        assert "Error" not in details and "<class" not in details, (name, details)
    assert shard.alive()


def test_probes_answer_during_attack(server):
    mode, shard = server
    messages = list(hostile_messages().values())
    stop = threading.Event()
    refusals: list[tuple[grpc.StatusCode, float]] = []

    def attack(offset: int) -> None:
        i = offset
        while not stop.is_set():
            method, raw = messages[i % len(messages)]
            code, _, took = refuse_one(shard.address, method, raw)
            refusals.append((code, took))
            i += 1

    metadata = (("authorization", f"Bearer {TOKEN}"),) if mode == "auth on" else ()
    latencies: dict[str, list[float]] = {"health": [], "forward": []}
    with grpc.insecure_channel(shard.address) as channel:
        health_check(channel)  # connected and warm before the attack starts
        good_forward(channel, metadata)
        attackers = [threading.Thread(target=attack, args=(k,), daemon=True) for k in range(3)]
        for t in attackers:
            t.start()
        try:
            deadline = time.monotonic() + ATTACK_S
            while time.monotonic() < deadline:
                for name, probe in (
                    ("health", lambda: health_check(channel)),
                    ("forward", lambda: good_forward(channel, metadata)),
                ):
                    t0 = time.monotonic()
                    probe()
                    latencies[name].append(time.monotonic() - t0)
                time.sleep(0.05)
        finally:
            stop.set()
            for t in attackers:
                t.join(timeout=120)
    worst = {name: max(values) for name, values in latencies.items()}
    print(f"{mode}: worst probe latency {worst}, {len(refusals)} hostile messages refused")
    print(
        sorted(round(x, 3) for x in latencies["health"])[-10:],
        sorted(round(t, 2) for _, t in refusals)[-10:],
    )
    assert refusals, "no hostile message was refused during the attack"
    assert all(took < REFUSE_LIMIT_S for _, took in refusals), refusals
    assert worst["health"] < PROBE_LIMIT_S and worst["forward"] < PROBE_LIMIT_S, worst
