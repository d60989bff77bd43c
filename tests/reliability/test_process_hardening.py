"""`expertd serve` as an operator runs it: stopped by SIGTERM while it is still
loading its checkpoint, the token given with a trailing newline (or blank), the
startup line stating the security posture, log lines that a client's text cannot
forge (text and JSON), and duplicate authorization headers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch

from expertd import wire
from expertd.launcher import start_shard, stop_shards, wait_serving
from expertd.v1 import expertd_pb2 as pb
from expertd.v1 import expertd_pb2_grpc as pb_grpc

TOKEN = "operator-token"
FORGED = "2030-01-01 00:00:00,000 INFO expertd.server: forged record"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint whose load takes a few seconds on a CPU (6 layers of `small`)."""
    path = tmp_path_factory.mktemp("ckpt") / "small6"
    done = subprocess.run(
        [sys.executable, "-m", "expertd", "make-checkpoint", str(path), "--layers", "6"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return path


def wait_for_line(shard, pattern: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not any(re.search(pattern, line) for line in shard.log):
        assert shard.alive(), "\n".join(shard.log[-20:])
        assert time.monotonic() < deadline, f"no log line {pattern!r}"
        time.sleep(0.02)


def assert_clean_exit(shard, timeout: float = 30) -> None:
    rc = shard.process.wait(timeout=timeout)
    time.sleep(0.2)  # the stderr pump's last lines
    text = "\n".join(shard.log)
    assert rc == 0, f"exit code {rc}:\n{text}"
    assert "Traceback" not in text and "terminate called" not in text, text


@pytest.mark.parametrize("when", ["before the first layer", "between layers"])
def test_sigterm_while_loading(checkpoint, when):
    shard = start_shard(["--checkpoint", str(checkpoint), "--torch-threads", "1"])
    try:
        if when == "between layers":
            wait_for_line(shard, r"loaded layer 0 ")
        shard.process.send_signal(signal.SIGTERM)
        assert_clean_exit(shard)
        assert any("stopped while loading" in line for line in shard.log), shard.log
    finally:
        if shard.alive():
            shard.process.kill()
            shard.process.wait()


def forward_request(layer: int = 0, trace_id: str = "") -> pb.ForwardRequest:
    x = torch.zeros((1, 512), dtype=torch.bfloat16)
    return pb.ForwardRequest(
        layer=layer,
        hidden_states=wire.encode(x),
        topk_ids=wire.encode(torch.tensor([[0]], dtype=torch.int32)),
        topk_weights=wire.encode(torch.tensor([[1.0]])),
        trace_id=trace_id,
    )


SMALL = ["--synthetic", "small", "--layers", "1", "--num-shards", "8", "--torch-threads", "1"]


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    """Token from a file, as `echo` writes it (trailing newline)."""
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN + "\n")
    shard = start_shard([*SMALL, "--auth-token-file", str(token_file)])
    try:
        wait_serving([shard], timeout=120)
        yield shard
    finally:
        stop_shards([shard], timeout=30)


def forward(address: str, metadata, req=None):
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.ExpertServiceStub(channel).Forward(
            req or forward_request(), timeout=30, metadata=metadata
        )


def test_token_with_trailing_newline_works(token_server):
    """From the file (token_server) and from EXPERTD_AUTH_TOKEN alike."""
    reply = forward(token_server.address, (("authorization", f"Bearer {TOKEN}"),))
    assert list(reply.output.shape) == [1, 512]
    shard = start_shard(SMALL, env={"EXPERTD_AUTH_TOKEN": f" {TOKEN}\n"})
    try:
        wait_serving([shard], timeout=120)
        reply = forward(shard.address, (("authorization", f"Bearer {TOKEN}"),))
        assert list(reply.output.shape) == [1, 512]
        with pytest.raises(grpc.RpcError) as info:
            forward(shard.address, ())
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        stop_shards([shard], timeout=30)


@pytest.mark.parametrize(
    "values",
    [
        [f"Bearer {TOKEN}", f"Bearer {TOKEN}"],
        [f"Bearer {TOKEN}", "Bearer wrong"],
        ["Bearer wrong", f"Bearer {TOKEN}"],
    ],
)
def test_duplicate_authorization_refused(token_server, values):
    with pytest.raises(grpc.RpcError) as info:
        forward(token_server.address, [("authorization", v) for v in values])
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_security_posture_logged_once(token_server):
    lines = [line for line in token_server.log if "security:" in line]
    assert len(lines) == 1, lines
    assert f"listening on {token_server.address}" in lines[0]
    assert "auth bearer token" in lines[0] and "TLS off" in lines[0]
    assert "metrics off" in lines[0]
    assert TOKEN not in "\n".join(token_server.log)


@pytest.mark.parametrize("token", ["", "  \n", "\t"])
def test_blank_token_refused_at_startup(token):
    done = subprocess.run(
        [sys.executable, "-m", "expertd", "serve", *SMALL],
        env={**os.environ, "EXPERTD_AUTH_TOKEN": token},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "EXPERTD_AUTH_TOKEN is empty" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert "LISTENING" not in done.stdout


def stream_refusal(address: str, trace_id: str, metadata=()) -> None:
    """A ForwardStream request for a layer the server lacks: refused, and logged."""
    with grpc.insecure_channel(address) as channel:
        replies = list(
            pb_grpc.ExpertServiceStub(channel).ForwardStream(
                iter([forward_request(layer=7, trace_id=trace_id)]), timeout=30, metadata=metadata
            )
        )
    assert replies[0].error.code == grpc.StatusCode.NOT_FOUND.value[0]


def test_text_log_lines_cannot_be_forged(token_server):
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    stream_refusal(token_server.address, f"trace-1\n{FORGED}\r\x1b[2J\u2028", metadata)
    wait_for_line(token_server, r"refused request trace-1")
    assert not any(line.startswith(FORGED) for line in token_server.log), token_server.log
    line = next(line for line in token_server.log if "refused request trace-1" in line)
    assert f"trace-1\\n{FORGED}\\r\\x1b[2J\\u2028" in line  # one line, escaped


def test_json_log_lines():
    shard = start_shard([*SMALL, "--log-format", "json"])
    try:
        wait_serving([shard], timeout=120)
        stream_refusal(shard.address, f'trace-2\n{{"forged": true}}\n{FORGED}')
        wait_for_line(shard, r"refused request trace-2")
    finally:
        stop_shards([shard], timeout=30)
    records = [json.loads(line) for line in shard.log if line.strip()]  # every line, one object
    refused = [r for r in records if "trace-2" in r["msg"]]
    assert len(refused) == 1
    assert refused[0]["msg"].startswith('refused request trace-2\n{"forged": true}\n')
    assert not any(r.get("forged") for r in records)
    assert any(r["msg"].startswith("security: ") for r in records)
