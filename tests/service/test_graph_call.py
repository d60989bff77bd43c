"""kernels/csrc/graph_call.cu, the lane's C call (server/lane.py), built here by the
host's C++ compiler (its code is host code only) and run against a stand-in driver: the
call's block (kernels/csrc/call_block.h) is host memory here as on the GPU, and the
"graph" reads the header and routes from it as the lane graph's first kernel does, copies
each row of x to the header's destination and flags a row whose first value is NaN.
Checked: the routes the GPU reads are those a full pack leaves (buckets of one block
interleaved), the header names the call, the steps come in stream order with the bell
only when asked for, an id out of range queues nothing, a flagged row and a failed driver
call are told apart, a call that does not fit is refused. The same call against the real
driver and graphs: tests/gpu/test_cuda_lane.py."""

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
    CallBlock,
    GraphCallPlan,
    _declare_graph_call,
)
from expertd.server.graphs import Layout

E = 64
CAPACITY = 16
LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
WRITE = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint
)
EVENT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
SYNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class Header(ctypes.Structure):  # struct expertd_call_header
    _fields_ = [
        ("x_src", ctypes.c_uint64),
        ("out_dst", ctypes.c_uint64),
        ("m", ctypes.c_int),
        ("pad_", ctypes.c_int * 11),
    ]


@pytest.fixture(scope="module")
def graph_call(tmp_path_factory):
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on this machine")
    lib = tmp_path_factory.mktemp("graph_call") / "libgraph_call.so"
    src = str(CSRC / "graph_call.cu")
    cmd = [cxx, "-x", "c++", "-O2", "-Wall", "-shared", "-fPIC", "-o", str(lib), src]
    subprocess.run(cmd, check=True)
    fn = ctypes.CDLL(str(lib)).expertd_graph_call
    _declare_graph_call(fn)
    return fn


class FakeDevice:
    """A slot's block in host memory and a driver that logs its calls; its "graph" of
    `rows` tokens does what a lane graph does with the block, with x copied as the
    output and row r flagged when x[r, 0] is NaN."""

    def __init__(self) -> None:
        self.shape = CallBlock(CAPACITY, 8)
        assert ctypes.sizeof(Header) == 64
        self.block = np.zeros(self.shape.nbytes, np.uint8)
        self.log: list[str] = []
        self.fail_at: str | None = None
        self.read: tuple[torch.Tensor, torch.Tensor] | None = None  # routes the GPU read
        self.rows = {}  # graph handle -> its rows

        def launch(graph, stream):
            self.log.append(f"graph {graph}")
            if self.fail_at == "graph":
                return 700
            rows, k = self.rows[graph], self.shape.top_k
            ids, w, flags = self.views(rows)
            self.read = (ids[: rows * k].view(rows, k).clone(), w[: rows * k].view(rows, k).clone())
            hdr = self.header()
            n = hdr.m * 2 * H
            ctypes.memmove(hdr.out_dst, hdr.x_src, n)
            x = np.frombuffer((ctypes.c_uint8 * n).from_address(hdr.x_src), np.uint8)
            first = torch.from_numpy(x.copy()).view(torch.bfloat16).view(hdr.m, H)[:, 0]
            flags[: hdr.m] = torch.isnan(first)
            return 0

        def write(stream, addr, value, flags):
            self.log.append(f"bell {value}")
            ctypes.c_uint32.from_address(addr).value = value
            return 0

        self._fns = (
            LAUNCH(launch),
            WRITE(write),
            EVENT(lambda event, stream: self.log.append("record") or 0),
            SYNC(lambda event: self.log.append("sync") or 0),
        )

    def header(self) -> Header:
        return Header.from_address(self.block.ctypes.data)

    def views(self, rows: int):
        """A graph of `rows` tokens' ids and weights in the block (what it copies in),
        and the flags."""
        b, s = torch.from_numpy(self.block), self.shape
        n = rows * s.top_k
        assert s.call_bytes(rows) == s.weights_offset(rows) + 4 * n
        ids = b[s.ids_offset : s.ids_offset + 4 * n].view(torch.int32)
        w = b[s.weights_offset(rows) : s.weights_offset(rows) + 4 * n].view(torch.float32)
        return ids, w, b[s.flags_offset : s.flags_offset + s.capacity]

    def plan(self, rows: int) -> GraphCallPlan:
        addr = self.block.ctypes.data
        fns = [ctypes.cast(f, ctypes.c_void_p).value for f in self._fns]
        self.rows[rows] = rows  # the "graph" handle is its rows
        return GraphCallPlan(
            header=addr,
            ids_host=addr + self.shape.ids_offset,
            weights_host=addr + self.shape.weights_offset(rows),
            flags_host=addr + self.shape.flags_offset,
            rows=rows,
            top_k=self.shape.top_k,
            num_experts=E,
            launch=fns[0],
            write=fns[1],
            record=fns[2],
            sync=fns[3],
        )


def _call(fn, plan, rows, ids, w, x, out, bell=(0, 0)):
    ids, w = ids.contiguous(), w.contiguous()
    m, k = ids.shape
    args = (ids.data_ptr(), w.data_ptr(), x.data_ptr(), out.data_ptr(), *bell)
    return fn(plan, rows, m, k, *args)


def _request(m: int, seed: int):
    return request(m, 8, torch.Generator().manual_seed(seed), experts=E)


def test_the_gpu_reads_a_full_packs_routes_and_the_header_names_the_call(graph_call):
    gen = torch.Generator().manual_seed(5)
    rnd = random.Random(5)
    dev = FakeDevice()
    plans = {r: dev.plan(r) for r in (1, 2, 4, 8, 16)}
    for _ in range(120):
        rows = rnd.choice(list(plans))
        m = rnd.randint(1, rows)
        x, ids, w = request(m, rnd.randint(1, 8), gen, experts=E)
        out = torch.empty_like(x)
        assert _call(graph_call, plans[rows], rows, ids, w, x, out) == GRAPH_CALL_OK
        assert torch.equal(out.view(torch.int16), x.view(torch.int16))
        hdr = dev.header()
        assert (hdr.m, hdr.x_src, hdr.out_dst) == (m, x.data_ptr(), out.data_ptr())
        _, want_ids, want_w = reference_pack(Layout(rows, 8, H), [x], [ids], [w])
        got_ids, got_w = dev.read
        assert torch.equal(got_ids, want_ids)
        assert torch.equal(got_w.view(torch.int32), want_w.view(torch.int32))


def test_steps_in_stream_order_and_the_bell_when_asked(graph_call):
    dev = FakeDevice()
    plan = dev.plan(8)
    x, ids, w = _request(3, seed=1)
    out = torch.empty_like(x)
    word = np.zeros(1, np.uint32)
    assert _call(graph_call, plan, 8, ids, w, x, out, (word.ctypes.data, 41)) == GRAPH_CALL_OK
    assert dev.log == ["graph 8", "bell 41", "record", "sync"] and int(word[0]) == 41
    dev.log.clear()
    assert _call(graph_call, plan, 8, ids, w, x, out) == GRAPH_CALL_OK
    assert dev.log == ["graph 8", "record", "sync"]


@pytest.mark.parametrize("bad_id", [E, -2, 2**31 - 1])
def test_an_id_out_of_range_queues_nothing(graph_call, bad_id):
    dev = FakeDevice()
    plan = dev.plan(4)
    x, ids, w = _request(4, seed=2)
    ids[3, 7] = bad_id
    assert _call(graph_call, plan, 4, ids, w, x, torch.empty_like(x)) == GRAPH_CALL_BAD_ID
    assert dev.log == []
    ids[3, 7] = E - 1  # the last expert and "no route" pass
    ids[0, 0] = -1
    assert _call(graph_call, plan, 4, ids, w, x, torch.empty_like(x)) == GRAPH_CALL_OK


def test_a_flagged_row_a_failed_step_and_a_call_that_does_not_fit(graph_call):
    dev = FakeDevice()
    plan = dev.plan(4)
    x, ids, w = _request(2, seed=3)
    bad = x.clone()
    bad[1, 0] = float("nan")
    assert _call(graph_call, plan, 4, ids, w, bad, torch.empty_like(x)) == GRAPH_CALL_NONFINITE
    assert _call(graph_call, plan, 4, ids, w, x, torch.empty_like(x)) == GRAPH_CALL_OK
    dev.fail_at = "graph"
    assert _call(graph_call, plan, 4, ids, w, x, torch.empty_like(x)) == GRAPH_CALL_FAILED
    assert plan.error.decode() == "cuGraphLaunch failed: CUresult 700"
    dev.fail_at, dev.log = None, []
    five = _request(5, seed=4)
    assert _call(graph_call, plan, 4, five[1], five[2], five[0], five[0]) == GRAPH_CALL_FAILED
    assert "5 tokens" in plan.error.decode()
    wide = torch.empty(2 * H + 8, dtype=torch.bfloat16)  # rows that start off 16 bytes
    odd = wide[1 : 1 + 2 * H].view(2, H)
    assert _call(graph_call, plan, 4, ids, w, odd, torch.empty_like(x)) == GRAPH_CALL_FAILED
    assert "aligned" in plan.error.decode() and dev.log == []
