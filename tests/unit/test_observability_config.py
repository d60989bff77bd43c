"""Observability pieces that need no process: where /metrics binds, the
Grafana dashboard against the series the server and the client SDK export,
the tracing switch, and start-up progress."""

from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from expertd import tracing
from expertd.client.telemetry import Telemetry
from expertd.progress import Progress
from expertd.server.app import metrics_address
from expertd.server.config import ServerConfig
from expertd.server.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "expertd.json"


@pytest.mark.parametrize(
    ("listen", "port", "metrics_listen", "expected"),
    [
        ("127.0.0.1:50051", None, None, None),  # off unless asked
        ("127.0.0.1:50051", 9400, None, ("127.0.0.1", 9400)),  # the serving host
        ("0.0.0.0:50051", 9400, None, ("0.0.0.0", 9400)),
        ("[::1]:50051", 9400, None, ("::1", 9400)),
        ("unix:/tmp/shard.sock", 9400, None, ("127.0.0.1", 9400)),
        ("127.0.0.1:50051", 9400, "10.1.2.3:9500", ("10.1.2.3", 9500)),  # moved
        ("127.0.0.1:50051", None, "[::]:9500", ("::", 9500)),
        ("127.0.0.1:50051", 9400, "off", None),  # off wins over a port (e.g. from the image)
        ("127.0.0.1:50051", 9400, "OFF", None),
    ],
)
def test_metrics_address(listen, port, metrics_listen, expected):
    config = ServerConfig(listen=listen, metrics_port=port, metrics_listen=metrics_listen)
    assert metrics_address(config) == expected


@pytest.mark.parametrize("bad", ["9400", "host:", "host:port"])
def test_metrics_address_refuses_garbage(bad):
    with pytest.raises(ValueError, match="HOST:PORT or off"):
        metrics_address(ServerConfig(metrics_listen=bad))


def _exported() -> set[str]:
    """Every series name the server's registry and the client SDK's histogram expose."""
    registry = CollectorRegistry()
    Telemetry(registry)
    names = set()
    for collect in (Metrics().registry.collect, registry.collect):
        for family in collect():
            kind = family.type
            if kind == "counter":
                names.add(family.name + "_total")
            elif kind == "histogram":
                names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
            else:
                names.add(family.name)
    return names


# PromQL words that are not series: functions, aggregations and their clauses.
_PROMQL = {
    "rate", "irate", "increase", "sum", "avg", "max", "min", "count", "by", "without",
    "histogram_quantile", "label_values", "topk", "bottomk", "on", "ignoring", "and", "or",
    "unless", "group_left", "group_right", "offset",
}  # fmt: skip


def _series(expr: str) -> set[str]:
    """The series names an expression reads."""
    expr = re.sub(r'"[^"]*"', "", expr)  # label values
    expr = re.sub(r"label_values\(([^,)]*),[^)]*\)", r"\1", expr)  # (series, label)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)  # grouping labels
    words = re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr)
    return {w for w in words if w not in _PROMQL}


def _expressions(node) -> list[str]:
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                found.append(value)
            else:
                found += _expressions(value)
    elif isinstance(node, list):
        for item in node:
            found += _expressions(item)
    return found


def test_dashboard_reads_only_exported_series():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 10
    exprs = _expressions(dashboard)
    assert len(exprs) >= len(panels)
    exported = _exported()
    used = set()
    for expr in exprs:
        series = _series(expr)
        assert series, expr
        missing = series - exported
        assert not missing, f"{expr!r} reads {sorted(missing)}, which nothing exports"
        used |= series
    # The series are on it: end to end, queue, batch size, bytes, process.
    for name in (
        "expertd_request_seconds_bucket",
        "expertd_queue_seconds_bucket",
        "expertd_batch_tokens_sum",
        "expertd_request_bytes_sum",
        "expertd_response_bytes_sum",
        "process_cpu_seconds_total",
    ):
        assert name in used, name
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_the_series_check_sees_a_wrong_name():
    assert _series('rate(expertd_nope_total{instance=~"$x"}[5m])') == {"expertd_nope_total"}
    assert _series("label_values(expertd_nope, instance)") == {"expertd_nope"}
    assert "expertd_nope_total" not in _exported()


def test_tracing_is_off_unless_asked(monkeypatch):
    monkeypatch.delenv(tracing.ENV, raising=False)
    assert tracing.configure() is False
    assert not tracing.active()
    with pytest.raises(ValueError, match="jsonl:PATH"):
        tracing.configure("zipkin")
    assert not tracing.active()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_a_bar_on_a_terminal():
    screen = _Terminal()
    bar = Progress("loading experts", 4, stream=screen)
    for n in range(1, 5):
        bar.update(n, f"loaded layer {n - 1}")
    bar.close()
    frames = screen.getvalue().split("\r\033[K")[1:]
    assert len(frames) == 4
    assert frames[0].startswith("loading experts [#####-----------------] 1/4 layers")
    assert "left" in frames[0] and "loaded layer 0" in frames[0]
    assert frames[-1].startswith("loading experts [######################] 4/4 layers")
    assert frames[-1].endswith("loaded layer 3\n")


def test_progress_logs_lines_elsewhere(caplog):
    caplog.set_level(logging.INFO, logger="expertd.test")
    bar = Progress("capturing", 50, log=logging.getLogger("expertd.test"), stream=io.StringIO())
    for n in range(1, 51):
        bar.update(n, f"layer {n - 1}")
    bar.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("layer 0 [1/50 layers, ") and "s left]" in lines[0]
    assert lines[-1].startswith("layer 49 [50/50 layers, ")
    assert len(lines) == 2  # the first and the last: the rest came within every_s


def test_trace_context_travels_as_four_numbers():
    """The slot transports carry a traceparent as (trace_hi, trace_lo, span_id, flags):
    the same traceparent comes back; none, or anything that is not one, is no parent."""
    value = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    fields = tracing.context_fields(value)
    assert fields == (0x0AF7651916CD43DD, 0x8448EB211C80319C, 0xB7AD6B7169203331, 1)
    assert tracing.from_fields(*fields) == value
    for bad in ("", "garbage", "00-" + "0" * 32 + "-b7ad6b7169203331-01", value[:-3] + "-zz"):
        assert tracing.context_fields(bad) == tracing.NO_CONTEXT
    assert tracing.from_fields(*tracing.NO_CONTEXT) == ""
