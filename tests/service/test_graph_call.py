"""kernels/csrc/graph_call.cu, the lane's C call (server/lane.py), built here by the
host's C++ compiler (its code is host code only) and run against a stand-in driver:
copies are memmoves between host buffers standing for the graph's device buffers, the
"graph" copies each row of x to the output and flags a row whose first value is NaN.
Checked: the routes it packs are those a full `HostStaging.pack` leaves (interleaved
with such packs on one buffer), the steps come in stream order with the bell only when
asked for, an id out of range queues nothing, a flagged row and a failed driver call
are told apart. The same call against the real driver: tests/gpu/test_cuda_lane.py."""

from __future__ import annotations

import ctypes
import random
import shutil
import subprocess

import numpy as np
import pytest
import torch
from test_staging import H, reference_pack, request

from expertd.kernels.build import CSRC
from expertd.kernels.cuda import (
    GRAPH_CALL_BAD_ID,
    GRAPH_CALL_FAILED,
    GRAPH_CALL_NONFINITE,
    GRAPH_CALL_OK,
    GraphCallPlan,
    _declare_graph_call,
)
from expertd.server.graphs import Layout
from expertd.server.staging import HostStaging

E = 64
COPY = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
)
LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
WRITE = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint
)
EVENT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
SYNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


@pytest.fixture(scope="module")
def graph_call(tmp_path_factory):
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on this machine")
    lib = tmp_path_factory.mktemp("graph_call") / "libgraph_call.so"
    subprocess.run(
        [
            cxx,
            "-x",
            "c++",
            "-O2",
            "-Wall",
            "-shared",
            "-fPIC",
            "-o",
            str(lib),
            str(CSRC / "graph_call.cu"),
        ],
        check=True,
    )
    fn = ctypes.CDLL(str(lib)).expertd_graph_call
    _declare_graph_call(fn)
    return fn


class FakeDevice:
    """A bucket's graph buffers in host memory and a driver that logs its calls."""

    def __init__(self, layout: Layout, host: HostStaging) -> None:
        self.layout = layout
        self.host = host  # the plan points into its buffers
        self.dev_in = np.zeros(layout.in_bytes, np.uint8)
        self.dev_out = np.zeros(layout.out_bytes, np.uint8)
        self.log: list[str] = []
        self.fail_at: str | None = None
        lay = layout

        def copy(dst, src, n, stream):
            in_at, out_at = self.dev_in.ctypes.data, self.dev_out.ctypes.data
            what = {in_at: "routes", in_at + lay.x_offset: "x"}.get(dst)
            what = what or ("flags" if src == out_at else "rows")
            self.log.append(what)
            if self.fail_at == what:
                return 700
            ctypes.memmove(dst, src, n)
            return 0

        def launch(graph, stream):
            self.log.append(f"graph {graph}")
            x, _, _ = lay.inputs(torch.from_numpy(self.dev_in))
            out, bad = lay.outputs(torch.from_numpy(self.dev_out))
            out.copy_(x)
            bad.copy_(torch.isnan(x[:, 0]))
            return 0

        def write(stream, addr, value, flags):
            self.log.append(f"bell {value}")
            ctypes.c_uint32.from_address(addr).value = value
            return 0

        self._fns = (
            COPY(copy),
            LAUNCH(launch),
            WRITE(write),
            EVENT(lambda event, stream: self.log.append("record") or 0),
            SYNC(lambda event: self.log.append("sync") or 0),
        )
        ids_at, weights_at = host.routes_at(layout)
        addr = [ctypes.cast(f, ctypes.c_void_p).value for f in self._fns]
        self.plan = GraphCallPlan(
            ids_host=ids_at,
            weights_host=weights_at,
            routes_bytes=layout.x_offset,
            routes_dev=self.dev_in.ctypes.data,
            x_dev=self.dev_in.ctypes.data + layout.x_offset,
            out_dev=self.dev_out.ctypes.data + layout.out_offset,
            flags_dev=self.dev_out.ctypes.data,
            flags_host=host.output.data_ptr(),
            row_bytes=2 * layout.hidden,
            rows=layout.rows,
            top_k=layout.top_k,
            num_experts=E,
            copy=addr[0],
            launch=addr[1],
            write=addr[2],
            record=addr[3],
            sync=addr[4],
        )


def _call(fn, dev: FakeDevice, ids, w, x, out, bell=(0, 0)):
    ids, w = ids.contiguous(), w.contiguous()
    m, k = ids.shape
    return fn(dev.plan, 7, m, k, ids.data_ptr(), w.data_ptr(), x.data_ptr(), out.data_ptr(), *bell)


def _device(rows: int, m: int, seed: int):
    """A fresh FakeDevice of a (rows, top-8) bucket, and a request of m tokens."""
    lay = Layout(rows, 8, H)
    host = HostStaging(pin=False, in_bytes=lay.in_bytes, out_bytes=lay.out_bytes)
    x, ids, w = request(m, 8, torch.Generator().manual_seed(seed), experts=E)
    return FakeDevice(lay, host), x, ids, w


def test_routes_are_a_full_packs_interleaved_with_packs(graph_call):
    gen = torch.Generator().manual_seed(5)
    rnd = random.Random(5)
    layouts = [Layout(r, 8, H) for r in (1, 2, 4, 8, 16)]
    host = HostStaging(pin=False)
    host.reserve(max(lay.in_bytes for lay in layouts), max(lay.out_bytes for lay in layouts))
    devs = {lay: FakeDevice(lay, host) for lay in layouts}
    for _ in range(120):
        lay = rnd.choice(layouts)
        m = rnd.randint(1, lay.rows)
        x, ids, w = request(m, rnd.randint(1, lay.top_k), gen, experts=E)
        if rnd.random() < 0.5:
            out = torch.empty_like(x)
            dev = devs[lay]
            assert _call(graph_call, dev, ids, w, x, out) == GRAPH_CALL_OK
            host.packed(lay, m)
            assert torch.equal(out.view(torch.int16), x.view(torch.int16))
            _, rid, rw = lay.inputs(torch.from_numpy(dev.dev_in))  # what the GPU read
        else:
            host.pack(lay, [x], [ids], [w])
            _, rid, rw = lay.inputs(host.input)
        _, want_ids, want_w = reference_pack(lay, [x], [ids], [w])
        assert torch.equal(rid, want_ids) and torch.equal(
            rw.view(torch.int32), want_w.view(torch.int32)
        )


def test_steps_in_stream_order_and_the_bell_when_asked(graph_call):
    dev, x, ids, w = _device(8, 3, seed=1)
    out = torch.empty_like(x)
    word = np.zeros(1, np.uint32)
    assert _call(graph_call, dev, ids, w, x, out, (word.ctypes.data, 41)) == GRAPH_CALL_OK
    steps = ["routes", "x", "graph 7", "rows", "flags"]
    assert dev.log == [*steps, "bell 41", "record", "sync"] and int(word[0]) == 41
    dev.log.clear()
    assert _call(graph_call, dev, ids, w, x, out) == GRAPH_CALL_OK
    assert dev.log == [*steps, "record", "sync"]


@pytest.mark.parametrize("bad_id", [E, -2, 2**31 - 1])
def test_an_id_out_of_range_queues_nothing(graph_call, bad_id):
    dev, x, ids, w = _device(4, 4, seed=2)
    ids[3, 7] = bad_id
    assert _call(graph_call, dev, ids, w, x, torch.empty_like(x)) == GRAPH_CALL_BAD_ID
    assert dev.log == []
    ids[3, 7] = E - 1  # the last expert and "no route" pass
    ids[0, 0] = -1
    assert _call(graph_call, dev, ids, w, x, torch.empty_like(x)) == GRAPH_CALL_OK


def test_a_flagged_row_and_a_failed_step_are_told_apart(graph_call):
    dev, x, ids, w = _device(4, 2, seed=3)
    bad = x.clone()
    bad[1, 0] = float("nan")
    assert _call(graph_call, dev, ids, w, bad, torch.empty_like(x)) == GRAPH_CALL_NONFINITE
    assert _call(graph_call, dev, ids, w, x, torch.empty_like(x)) == GRAPH_CALL_OK
    dev.fail_at = "rows"
    assert _call(graph_call, dev, ids, w, x, torch.empty_like(x)) == GRAPH_CALL_FAILED
    assert dev.plan.error.decode() == "cuMemcpyAsync (rows) failed: CUresult 700"
    five = request(5, 8, torch.Generator().manual_seed(4), experts=E)
    assert _call(graph_call, dev, five[1], five[2], five[0], five[0]) == GRAPH_CALL_FAILED
    assert "5 tokens" in dev.plan.error.decode()
