"""Observability on real servers: the /metrics endpoint scraped over HTTP (series,
types, where it binds, off), the client's stage timings, and a trace that links
the client's spans to a shard process's spans through traceparent."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import torch
from conftest import hidden, routing, shard_config
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from expertd import nixl, tracing
from expertd.client import ExpertClient
from expertd.launcher import start_shard, stop_shards, wait_serving
from expertd.server.app import BackgroundServer

H = 512  # the small preset's hidden size
CALLS = 3


def _scrape(host: str, port: int) -> str:
    url = f"http://{host}:{port}/metrics"
    return urllib.request.urlopen(url, timeout=10).read().decode()


def _call(address: str, m: int = 4, calls: int = CALLS, **options) -> ExpertClient:
    gen = torch.Generator().manual_seed(1)
    client = ExpertClient([address], **options)
    for _ in range(calls):
        ids, w = routing(m, gen)
        client.forward(1, hidden(m, gen), ids, w)
    return client


@pytest.fixture(scope="module")
def one_shard():
    """One shard owning every expert, with /metrics on a free port of its host."""
    with BackgroundServer(shard_config(0, num_shards=1, metrics_port=0)) as server:
        yield server


def test_metrics_follow_prometheus_conventions(one_shard):
    running = one_shard._running
    assert running.metrics_host == "127.0.0.1"  # the serving host, not every interface
    before = {
        f.name: f
        for f in text_string_to_metric_families(_scrape("127.0.0.1", running.metrics_port))
    }
    _call(one_shard.address, m=4, transport="grpc").close()
    text = _scrape("127.0.0.1", running.metrics_port)
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def count(name, fams):
        if name not in fams:
            return 0
        return next(s.value for s in fams[name].samples if s.name == f"{name}_count")

    for name in (
        "expertd_request_seconds",  # end to end in the server
        "expertd_queue_seconds",
        "expertd_compute_seconds",
        "expertd_encode_seconds",
        "expertd_batch_tokens",
        "expertd_batch_requests",
        "expertd_request_bytes",
        "expertd_response_bytes",
    ):
        family = families[name]
        assert family.type == "histogram", name
        buckets = [s for s in family.samples if s.name == f"{name}_bucket"]
        assert len(buckets) > 3 and buckets[-1].labels["le"] == "+Inf", name
    for name in ("expertd_request_seconds", "expertd_queue_seconds", "expertd_request_bytes"):
        assert count(name, families) - count(name, before) == CALLS, name
    # A call of 4 tokens: bf16 [4, H] + int32 and float32 [4, 8] in, bf16 [4, H] out.
    sent = families["expertd_response_bytes"].samples
    total = next(s.value for s in sent if s.name == "expertd_response_bytes_sum")
    previous = next(
        (s.value for s in before["expertd_response_bytes"].samples if s.name.endswith("_sum")), 0
    )
    assert total - previous == CALLS * 4 * H * 2
    assert families["expertd_requests"].type == "counter"
    assert families["expertd_inflight_requests"].type == "gauge"
    for name in ("process_cpu_seconds", "process_resident_memory_bytes", "process_open_fds"):
        assert name in families, name  # the standard process collector
    assert "python_info" in families
    assert "_created" not in text  # none unless asked


def test_created_series_only_when_asked(bank0_one):
    config = shard_config(0, num_shards=1, metrics_port=0, metrics_created=True)
    with BackgroundServer(config, bank=bank0_one) as server:
        text = _scrape("127.0.0.1", server._running.metrics_port)
    assert "expertd_requests_created" not in text  # no request yet: no labelled series
    assert "expertd_request_seconds_created" in text


def _loopback_alias_usable() -> bool:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _loopback_alias_usable(), reason="127.0.0.2 cannot be bound here")
def test_metrics_bind_the_serving_host_or_where_told(bank0_one):
    config = shard_config(0, num_shards=1, listen="127.0.0.2:0", metrics_port=0)
    with BackgroundServer(config, bank=bank0_one) as server:
        port = server._running.metrics_port
        assert "expertd_tokens_total" in _scrape("127.0.0.2", port)
        with pytest.raises(urllib.error.URLError):  # not on the other loopback address
            _scrape("127.0.0.1", port)
    config = shard_config(0, num_shards=1, listen="127.0.0.2:0", metrics_listen="127.0.0.1:0")
    with BackgroundServer(config, bank=bank0_one) as server:
        assert server._running.metrics_host == "127.0.0.1"
        assert "expertd_tokens_total" in _scrape("127.0.0.1", server._running.metrics_port)


def test_metrics_off(bank0_one):
    config = shard_config(0, num_shards=1, metrics_port=0, metrics_listen="off")
    with BackgroundServer(config, bank=bank0_one) as server:
        assert server._running.metrics_port is None
        assert server._running.metrics is not None  # still counted, just not served


@pytest.fixture(scope="module")
def bank0_one(one_shard):
    return one_shard.bank


@pytest.mark.parametrize("transport", ["grpc", "unary", "shm"])
def test_client_stage_timings(one_shard, transport):
    registry = CollectorRegistry()
    client = _call(one_shard.address, transport=transport, metrics=registry)
    try:
        timings = client.timings()
    finally:
        client.close()
    stages = {"stage", "route", "rpc", "server", "server_queue", "transfer", "sum", "call"}
    if transport != "shm":
        stages |= {"encode", "decode"}  # grpc's serializer and deserializer, timed
    assert stages <= set(timings), timings
    for stage in stages:
        assert timings[stage]["count"] >= CALLS, stage
    assert timings["rpc"]["total_s"] >= timings["server"]["total_s"]
    for stage in stages:  # the same figures in the caller's registry
        n = registry.get_sample_value("expertd_client_stage_seconds_count", {"stage": stage})
        assert n == timings[stage]["count"], stage


@pytest.fixture
def memory_tracing():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.configure(provider=provider)
    yield exporter
    tracing.configure("off")
    provider.shutdown()


TRACED_TRANSPORTS = ["grpc", "unary", "shm", "tcp"]
if nixl.load() is not None:
    TRACED_TRANSPORTS.append("nixl")


@pytest.mark.parametrize("transport", TRACED_TRANSPORTS)
def test_trace_links_client_and_shard_process(tmp_path, memory_tracing, transport):
    """A shard process writing its spans to a file (--trace jsonl:PATH), the client
    in this process keeping its spans in memory: one trace id, and the shard's
    request span is a child of the client's span for that shard call, whichever
    way the call travelled (gRPC metadata or message, or a slot's call header)."""
    path = tmp_path / "spans.jsonl"
    args = ["--synthetic", "small", "--layers", "2", "--device", "cpu"]
    shard = start_shard([*args, "--trace", f"jsonl:{path}"])
    try:
        wait_serving([shard], timeout=120)
        _call(shard.address, calls=2, transport=transport).close()
    finally:
        stop_shards([shard], timeout=60)  # SIGTERM: the server flushes its spans
    client = {f"{s.context.span_id:016x}": s for s in memory_tracing.get_finished_spans()}
    server = [json.loads(line) for line in path.read_text().splitlines()]
    calls = [s for s in client.values() if s.name == "expertd.client.call"]
    assert len(calls) == 2
    for call in calls:
        trace_id = f"{call.context.trace_id:032x}"
        mine = {i: s for i, s in client.items() if f"{s.context.trace_id:032x}" == trace_id}
        theirs = {s["span_id"]: s for s in server if s["trace_id"] == trace_id}
        by_name = {}
        for i, s in mine.items():
            by_name.setdefault(s.name, []).append(i)
        fanout = client[by_name["expertd.client.fanout"][0]]
        assert fanout.parent.span_id == call.context.span_id
        shard_call = client[by_name["expertd.client.shard"][0]]
        assert shard_call.parent.span_id == fanout.context.span_id
        assert shard_call.attributes["expertd.server_us"] > 0
        if transport in ("shm", "tcp", "nixl"):
            assert shard_call.attributes["expertd.transport"] == "slot"
        requests = [s for s in theirs.values() if s["name"] == "expertd.server.request"]
        assert len(requests) == 1
        request = requests[0]
        assert request["parent_span_id"] == f"{shard_call.context.span_id:016x}"
        assert request["service"] == "expertd"
        if transport in ("shm", "tcp", "nixl"):  # it came through a slot
            assert request["attributes"]["expertd.transport"] == "slot"
        children = {
            s["name"]: s for s in theirs.values() if s["parent_span_id"] == request["span_id"]
        }
        assert set(children) == {
            "expertd.server.queue",
            "expertd.server.forward",
            "expertd.server.encode",
        }
        assert children["expertd.server.forward"]["attributes"]["expertd.batch_tokens"] >= 4
        for child in children.values():  # inside their request
            assert request["start_ns"] <= child["start_ns"] <= child["end_ns"] <= request["end_ns"]


def test_oip_model_infer_joins_the_callers_trace(one_shard, memory_tracing):
    """A ModelInfer carrying a W3C traceparent in its metadata: the server's request
    span is that span's child (the OIP service of an in-process shard)."""
    import grpc

    from expertd.v1 import inference_pb2 as oip
    from expertd.v1 import inference_pb2_grpc as oip_grpc

    gen = torch.Generator().manual_seed(3)
    x = hidden(2, gen)
    ids, w = routing(2, gen)
    request = oip.ModelInferRequest(model_name="moe")
    request.parameters["layer"].int64_param = 1
    for name, t, dtype in (("hidden_states", x, "BF16"), ("topk_ids", ids, "INT32")):
        request.inputs.add(name=name, datatype=dtype, shape=list(t.shape))
        request.raw_input_contents.append(t.contiguous().view(torch.uint8).numpy().tobytes())
    request.inputs.add(name="topk_weights", datatype="FP32", shape=list(w.shape))
    request.raw_input_contents.append(w.contiguous().numpy().tobytes())
    trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    md = (("traceparent", f"00-{trace_id}-{span_id}-01"),)
    with grpc.insecure_channel(one_shard.address) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        answer = stub.ModelInfer(request, timeout=30, metadata=md)
    assert list(answer.outputs[0].shape) == [2, x.shape[1]]
    requests = [
        s for s in memory_tracing.get_finished_spans() if s.name == "expertd.server.request"
    ]
    assert len(requests) == 1
    assert f"{requests[0].context.trace_id:032x}" == trace_id
    assert f"{requests[0].parent.span_id:016x}" == span_id


def test_tracing_off_makes_no_spans(one_shard, memory_tracing):
    tracing.configure("off")
    _call(one_shard.address, calls=1, transport="grpc").close()
    assert memory_tracing.get_finished_spans() == ()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--metrics-listen", "9400"], "HOST:PORT or off"),
        (["--trace", "zipkin"], "off, on, console, otlp or jsonl:PATH"),
    ],
)
def test_bad_observability_flags_exit_2_naming_the_problem(flags, words):
    done = subprocess.run(
        [sys.executable, "-m", "expertd", "serve", "--synthetic", "small", "--layers", "1", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert words in done.stderr
