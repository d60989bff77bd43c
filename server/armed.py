"""Armed calls: a client's CUDA stream starts this shard's forward, no host in between.

An on-stream call (client/onstream.py) reaches a shard as a doorbell its host must see,
read, check and launch: on the H100 that host work was 100-250 us of a call whose
forward takes 20-100 us at decode sizes. Here the shard queues the work before the
call exists. Per cuda-ipc lease whose client numbers its calls on the lease's ring
(dp.FEATURE_ARMED), on a stream of the lease's own, for each of the next DEPTH ring
entries n:

    store n into the entry word                      (cuStreamWriteValue32)
    wait until the ring's word for n reaches n       (cuStreamWaitValue32: the client's
                                                      stream stores it after the call's rows)
    the armed graph (kernels/csrc/armed.cu):         copy the call into this lease's bank,
                                                      run the bucket's captured forward
                                                      (a switch over layer x bucket), copy
                                                      the rows into the slot, store done_seq

So the caller's stream goes on once the GPU has done the work; the host, woken by the
doorbell as for any call, only keeps the books: it waits for the entry's end, and when
the GPU took the call (taken_seq = the call's seq) checks it as Forward would and
answers the slot (status, timing); a call the GPU did not take (larger than the bank's
buckets, a route id outside [-1, E), an entry cancelled or never armed) runs the usual
way. An error found after the GPU ran a call (a refused id, a NaN) is the call's
answer, raised late by the client as on-stream errors are.

A wait queued on the GPU holds anything that waits for the whole device (a device
synchronize, a capture's synchronize, cudaFree): a lease whose armed entries wait
longer than IDLE_S cancels them (the host stores the cancel word, then satisfies the
waits itself) and arms again at its next call; so does a lease that ends.

The bank is this lease's own (GraphBank, buckets up to MAX_ROWS, a workspace and graph
pool of its own), captured once per lease in a thread while the lease's first calls
run the usual way.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time

import torch

from expertd import cudamem
from expertd import dataplane as dp
from expertd.kernels import armed as ka
from expertd.server.graphs import DEFAULT_BUCKETS, GraphBank

log = logging.getLogger("expertd.server")

# Ring entries armed ahead per lease. One: the switch's body runs behind whatever the
# lease's stream holds next, so an entry armed behind a running one (waiting for a call
# that comes only once this one is answered) held it until IDLE_S released it (H100,
# MPS: 74 ms a call at DEPTH 2).
DEPTH = 1
MAX_ROWS = 64  # the largest call the GPU runs by itself (decode sizes)
IDLE_S = 0.05  # armed entries waiting this long with no call are cancelled
GRID = 64  # blocks of the copy kernels


def supported(runner) -> bool:
    """Whether this server arms calls: CUDA graphs of the cuda backend, on a GPU shared
    through MPS. Without MPS the GPU time-slices between the client's process and this
    one, and a wait always pending in this one's context costs every call a few slices
    (H100, preset small, M = 1: 4.4 ms a call armed against 0.5 ms on the host)."""
    return (
        runner.graphs is not None
        and hasattr(runner.bank.backend, "sibling")
        and cudamem.mps_control_pipe() is not None
    )


class _Entry:
    __slots__ = ("end", "n", "start")

    def __init__(self, n: int, start, end) -> None:
        self.n, self.start, self.end = n, start, end


class ArmedLease:
    """One lease's armed entries, bank, graph and stream. `claim` for each stream call."""

    def __init__(self, runner, slots: list, device: torch.device) -> None:
        self.runner = runner
        self.slots = slots
        self.device = device
        self.lock = threading.Lock()
        self.ready = False
        self.closed = False
        self.next = 1  # the next ring entry to arm (entries from 1)
        self.armed: dict[int, _Entry] = {}  # waiting or running on the GPU
        self.cancelled: dict[int, _Entry] = {}
        self.last = time.monotonic()  # the last arm or claim
        self._graph: ka.ArmedGraph | None = None
        self._stream_ptr = 0
        self._thread = threading.Thread(target=self._build, name="expertd-armed", daemon=True)
        self._thread.start()

    # -- setup ------------------------------------------------------------------------

    def _build(self) -> None:
        try:
            self._setup()
        except Exception:
            log.exception("armed calls unavailable on this lease")
            return
        with self.lock:
            if self.closed:
                self._teardown()
                return
            self.ready = True
        threading.Thread(target=self._watch, name="expertd-armed-idle", daemon=True).start()

    def _setup(self) -> None:
        runner, dev = self.runner, self.device
        info = runner.bank.info
        layers = list(info.layers)
        lay0 = self.slots[0].layout
        top_k = runner.graphs.top_k
        cap = min(MAX_ROWS, lay0.max_tokens)
        buckets = [b for b in DEFAULT_BUCKETS if b <= cap]
        if not buckets:
            raise RuntimeError(f"no bucket for slots of {lay0.max_tokens} rows")
        backend = runner.bank.backend.sibling()
        bank = GraphBank(backend, runner.hidden, top_k, buckets, slots=1, keep_graphs=True)
        with torch.cuda.device(dev):
            for layer in layers:
                bank.capture(layer, runner.bank.state(layer))
        ctl_ptrs = []
        for slot in self.slots:
            ptr = slot.ctl_device()
            if ptr is None:
                raise RuntimeError("a slot's control block is not mapped for the GPU")
            ctl_ptrs.append(ptr)
        table = []
        for slot, ctl in zip(self.slots, ctl_ptrs, strict=True):
            x = slot.dev.tensor.data_ptr()
            table += [ctl, x, x + slot.layout.device_out_offset]
        self._keep = {
            "bank": bank,
            "slots": torch.tensor(table, dtype=torch.int64, device=dev),
            "layer_body": torch.full((max(layers) + 1,), -1, dtype=torch.int32, device=dev),
            "buckets": torch.tensor(buckets, dtype=torch.int32, device=dev),
            "info": torch.zeros(ka.INFO_WORDS, dtype=torch.int32, device=dev),
            "entry": torch.zeros(1, dtype=torch.int32, device=dev),
        }
        bank_in, bank_out = bank.buffers(0)
        ring0 = ctl_ptrs[0]
        c = dp.Control
        plan = ka.ArmPlan(
            slots=self._keep["slots"].data_ptr(),
            num_slots=len(self.slots),
            ring_seq=ring0 + dp.RING_SEQ_OFFSET,
            ring_slot=ring0 + dp.RING_SLOT_OFFSET,
            ring=dp.RING,
            entry=self._keep["entry"].data_ptr(),
            cancel=ring0 + dp.RING_CANCEL_OFFSET,
            layer_body=self._keep["layer_body"].data_ptr(),
            num_layers=max(layers) + 1,
            buckets=self._keep["buckets"].data_ptr(),
            num_buckets=len(buckets),
            top_k=top_k,
            hidden=runner.hidden,
            num_experts=info.num_experts,
            bank_in=bank_in.data_ptr(),
            bank_out=bank_out.data_ptr(),
            info=self._keep["info"].data_ptr(),
            words=ka.ArmWords(
                req_seq=c.req_seq.offset,
                layer=c.layer.offset,
                m=c.m.offset,
                k=c.k.offset,
                flags=c.flags.offset,
                done_seq=c.done_seq.offset,
                taken_seq=c.taken_seq.offset,
                armed_bad=c.armed_bad.offset,
                ids=lay0.ids_offset,
                weights=lay0.weights_offset,
            ),
        )
        # One run of buckets per layer id up to the largest held (a body's index is
        # layer * buckets + bucket); ids not held reuse the first layer's graphs, and are
        # never picked (layer_body -1).
        per_layer = {layer: [bank.raw(layer, b) for b in buckets] for layer in layers}
        bodies = [g for i in range(max(layers) + 1) for g in per_layer.get(i, per_layer[layers[0]])]
        for layer in layers:
            self._keep["layer_body"][layer] = layer
        with torch.cuda.device(dev):
            self._graph = ka.ArmedGraph(plan, bodies, GRID)
            self._stream_ptr = ka.nonblocking_stream()
            self._stream = torch.cuda.ExternalStream(self._stream_ptr, device=dev)
        self._ring_seq = ring0 + dp.RING_SEQ_OFFSET
        self._entry = self._keep["entry"].data_ptr()
        torch.cuda.synchronize(dev)  # the tables are on the device before anything waits
        log.debug(
            "armed calls on: %d slot(s), %d layer(s) x buckets %s",
            len(self.slots),
            len(layers),
            buckets,
        )

    # -- arming -----------------------------------------------------------------------

    def _arm_more(self) -> None:
        """Arm entries until DEPTH wait. Under self.lock."""
        while self.ready and not self.closed and len(self.armed) < DEPTH:
            n = self.next
            self.next = (n + 1) & 0xFFFFFFFF or 1
            s = self._stream
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            cudamem.write_value(s, self._entry, n)
            cudamem.wait_value(s, self._ring_seq + 4 * (n % dp.RING), n, cudamem.WAIT_GEQ)
            start.record(s)
            self._graph.launch(self._stream_ptr)
            end.record(s)
            self.armed[n] = _Entry(n, start, end)
            self.last = time.monotonic()

    def claim(self, slot) -> tuple[bool, bool, float] | None:
        """For a stream call rung on `slot` (its waiter thread): None when the GPU was not
        armed for it (run it the usual way), else (taken, bad, device_us) once the GPU is
        done with its entry: taken = the GPU ran the call and released the caller's
        stream; bad = a row held NaN/Inf."""
        ctl = slot.ctl
        n = ctl.ring_n
        with self.lock:
            self.last = time.monotonic()
            entry = self.armed.get(n) or self.cancelled.get(n)
            if entry is None:
                if n and _after(n, self.next):
                    self.next = (n + 1) & 0xFFFFFFFF or 1  # it runs the usual way
                self._arm_more()
                return None
        entry.end.synchronize()  # (a wait left unsatisfied is released by _cancel)
        taken = ctl.taken_seq == slot.seq
        bad = taken and bool(ctl.armed_bad)
        device_us = entry.start.elapsed_time(entry.end) * 1e3
        with self.lock:
            self.armed.pop(n, None)
            self.cancelled.pop(n, None)
            self._arm_more()
        return taken, bad, device_us

    # -- idle and close -----------------------------------------------------------------

    def _cancel(self) -> None:
        """Release every armed wait: the GPU declines those entries (the host runs their
        calls if they come). Under self.lock; host stores only (no CUDA call)."""
        if not self.armed or self.slots[0].mm is None:
            return
        mm = self.slots[0].mm
        last = (self.next - 1) & 0xFFFFFFFF  # every armed entry comes before next
        ctypes.c_uint32.from_buffer(mm, dp.RING_CANCEL_OFFSET).value = last
        for n, entry in self.armed.items():
            word = ctypes.c_uint32.from_buffer(mm, dp.RING_SEQ_OFFSET + 4 * (n % dp.RING))
            if _after(n, word.value):
                word.value = n
            self.cancelled[n] = entry
        self.armed.clear()
        for n in [n for n in self.cancelled if _after(self.next, (n + dp.RING) & 0xFFFFFFFF)]:
            del self.cancelled[n]

    def _watch(self) -> None:
        while True:
            time.sleep(IDLE_S / 2)
            with self.lock:
                if self.closed:
                    return
                if self.armed and time.monotonic() - self.last > IDLE_S:
                    self._cancel()

    def close(self) -> None:
        """Cancel what is armed and free the lease's GPU objects (before its slots unmap)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if not self.ready:
                return  # the builder frees what it made
            self._cancel()
        self._teardown()

    def _teardown(self) -> None:
        if self._stream_ptr:
            try:
                torch.cuda.ExternalStream(self._stream_ptr, device=self.device).synchronize()
                ka.destroy_stream(self._stream_ptr)
            except RuntimeError as e:
                log.warning("armed stream not released: %s", e)
            self._stream_ptr = 0
        if self._graph is not None:
            self._graph.destroy()
            self._graph = None
        self._keep = {}


def _after(a: int, b: int) -> bool:
    """a comes at or after b on the ring's 32-bit count."""
    return ((a - b) & 0xFFFFFFFF) < 0x80000000
