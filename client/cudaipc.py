"""The client's side of the `cuda-ipc` same-host data plane: slots whose x and out
regions are the shard's GPU memory, mapped into this process (expertd/cudamem.py).

Leasing, the control block, the doorbell, deadlines and the lease's end are the
`shm` slots' (client/shm.py): only where the rows live differs. A call gathers the
routed rows of the caller's hidden states on the GPU straight into the slot's x
region (on a side stream; the caller's inputs were complete when they were
checked, client/core.stage_inputs), writes ids and weights into the host control
slot (the shard checks them there), waits for the gather and rings. The shard
reads x and writes its partial on its GPU; the answer is a bf16 [rows, H] view of
the slot's out region on the device, summed on the caller's GPU
(client/devsum.py) while the slot is held.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

import numpy as np
import torch

from expertd import cudamem
from expertd import dataplane as dp
from expertd.client.shm import NO_TRACE, LeaseError, ShmChannel, Slot, write_trace
from expertd.cudamem import ImportedBuffer, available, on_stream

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_STREAMS_LOCK = threading.Lock()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per GPU for the slots' gathers."""
    with _STREAMS_LOCK:
        stream = _STREAMS.get(device)
        if stream is None:
            stream = _STREAMS[device] = torch.cuda.Stream(device)
        return stream


def gather_rows(slot, x: torch.Tensor, tokens, m: int) -> None:
    """Queue on `slot.stream` the copy of x's rows `tokens` (None: all m, in order) into
    `slot.x_dev` (a device slot: cuda-ipc, or NIXL on GPU memory), once the last sum
    has read the slot's out region (the shard overwrites it once called). x: the
    caller's bf16 [M, H] on any device, complete (client/core.stage_inputs waited for
    the caller's stream)."""
    stream = slot.stream
    if slot.reading:
        stream.wait_event(slot.read_done)
        slot.reading = False
    if not m:
        return
    dst = slot.x_dev[:m]
    with on_stream(stream):
        if tokens is None:
            dst.copy_(x, non_blocking=True)
        else:
            # page-locked, so the copy queues on the stream instead of the host
            # waiting for it (a pageable copy returns once it is done)
            host_rows = torch.from_numpy(np.ascontiguousarray(tokens)).pin_memory()
            rows = host_rows.to(x.device, non_blocking=True)
            if x.device == dst.device:
                torch.index_select(x, 0, rows, out=dst)
            else:
                dst.copy_(x.index_select(0, rows), non_blocking=True)


def usable() -> tuple[bool, str]:
    """Can this process lease cuda-ipc slots? Only where it works on a GPU already
    (CUDA initialized: a process that never touched CUDA is not given a context by
    the data plane's choice), and can load the CUDA runtime."""
    if not torch.cuda.is_available():
        return False, "no CUDA device in this process"
    if not torch.cuda.is_initialized():
        return False, "CUDA is not in use in this process"
    return available()


class CudaIpcSlot(Slot):
    """One cuda-ipc slot: the shm slot's control block, ids and weights on the host,
    x and out in the shard's GPU memory."""

    on_device = True  # start() takes the caller's tensor; result() is a GPU tensor

    def __init__(self, lease, index: int, fd: int, layout: dp.Layout, mem: ImportedBuffer):
        super().__init__(lease, index, fd, layout)
        self.mem = mem
        mmax, h = layout.max_tokens, layout.hidden
        t = mem.tensor
        n = 2 * mmax * h
        self.x_dev = t[:n].view(torch.bfloat16).view(mmax, h)
        off = layout.device_out_offset
        self.out_dev = t[off : off + n].view(torch.bfloat16).view(mmax, h)
        self.stream = side_stream(t.device)
        # A caller's stream may still be summing the last answer out of the out region
        # (devsum.DeviceSum.finish with `done`): the next call's ring waits for it.
        self.read_done = torch.cuda.Event()
        self.reading = False
        # A shard whose slots have a semaphore is woken through it (a doorbell rung by a
        # CUDA stream is followed by no FUTEX_WAKE, client/onstream.py); said before PROOF.
        self.sem = 0
        if self.ctl.features & dp.FEATURE_SEM:
            self.ctl.wake = dp.WAKE_SEM
            self.sem = ctypes.addressof(self.ctl) + dp.SEM_OFFSET
        # On-stream calls (client/onstream.py): the host slot page-locked and mapped for
        # the GPU on first use, torch views of its routes regions, the event after the
        # answer's copy out.
        self._mapped: cudamem.PinnedHost | None = None
        self.ids_host: torch.Tensor | None = None
        self.w_host: torch.Tensor | None = None
        self.done = torch.cuda.Event()
        # Calls captured in a CUDA graph: the routes regions as CUDA tensors over the
        # mapped host slot (the graph's copies write them as kernels do), made once
        self.ids_mapped: torch.Tensor | None = None
        self.w_mapped: torch.Tensor | None = None

    def stream_words(self) -> tuple[int, int]:
        """(req_seq, done_seq) as the GPU addresses them: the host slot is page-locked
        and mapped into the GPUs' address space the first time."""
        if self._mapped is None:
            base = ctypes.addressof(self.ctl)
            with torch.cuda.device(self.mem.device):
                self._mapped = cudamem.PinnedHost(
                    base, self.layout.byte_size, self.mem.device, mapped=True
                )
            self.ids_host = torch.from_numpy(self.ids)
            self.w_host = torch.from_numpy(self.w)
        dev = self._mapped.device_ptr
        return dev + dp.Control.req_seq.offset, dev + dp.Control.done_seq.offset

    def map_routes(self) -> None:
        """`stream_words`, and the routes regions as int32 / fp32 CUDA tensors over the
        mapped host slot, for a graph's copies (outside any capture: page-locking and
        mapping are not captured work)."""
        self.stream_words()
        if self.ids_mapped is None:
            lay = self.layout
            n = 4 * lay.max_tokens * lay.top_k
            self.ids_mapped = self._mapped.device_tensor(lay.ids_offset, n).view(torch.int32)
            self.w_mapped = self._mapped.device_tensor(lay.weights_offset, n).view(torch.float32)

    def write_proof(self, nonce: int) -> None:
        """The registration nonce into the device out region too (the shard reads it
        there: its memory and this mapping are the same)."""
        word = torch.tensor([nonce], dtype=torch.int64).view(torch.uint8)
        self.out_dev.view(torch.uint8).view(-1)[:8].copy_(word)
        torch.cuda.synchronize(self.out_dev.device)

    def start(
        self,
        layer: int,
        x: torch.Tensor,
        tokens,
        ids,
        w,
        timeout: float,
        notify: bool,
        ring: bool = True,
        trace=NO_TRACE,
    ):
        """Gather one call's rows into the slot (on the side stream), write its routes
        and header; ring (or leave that to `ring()`). x: the caller's bf16 [M, H] on any
        device; tokens: the rows of it to send (None: all, in order), ids/w: [m, k]
        host arrays."""
        m, k = ids.shape
        self.layout.check(m, k)
        gather_rows(self, x, tokens, m)
        if m:
            self.ids[: m * k] = ids.reshape(-1)
            self.w[: m * k] = w.reshape(-1)
        ctl = self.ctl
        ctl.layer = layer
        ctl.m = m
        ctl.k = k
        ctl.flags = dp.FLAG_NOTIFY if notify else 0
        ctl.timeout_us = max(int(timeout * 1e6), 1)
        write_trace(ctl, trace)
        self.rows = m
        if ring:
            self.ring()

    def ring(self, gathered: bool = False) -> None:
        """The doorbell, once the rows are in the shard's memory (`gathered`: the
        caller has waited for this slot's stream already, as for several slots that
        share it)."""
        if not gathered:
            self.stream.synchronize()
        super().ring()

    def wake(self) -> None:
        """The slot's semaphore when the shard has one (its waiter sleeps on it), else
        FUTEX_WAKE."""
        if self.sem:
            dp.sem_post(self.sem)
        else:
            super().wake()

    def result(self) -> torch.Tensor:
        """The answer: bf16 [rows, H] viewing the out region on the shard's GPU (read it
        before releasing the slot); raises StreamCallError with the shard's status when
        the call failed."""
        return self.out_dev[: self.checked_rows()]

    def unmap(self) -> None:
        if self.ctl is None:
            return
        if self.reading:  # a caller's stream may still read the out region
            self.read_done.synchronize()
            self.reading = False
        self.done.synchronize()  # an on-stream call's copies and host function are done
        self.ids_host = self.w_host = self.ids_mapped = self.w_mapped = None
        if self._mapped is not None:
            mapped, self._mapped = self._mapped, None
            with contextlib.suppress(Exception):
                mapped.release()
        super().unmap()
        self.x_dev = self.out_dev = None
        mem, self.mem = self.mem, None
        if mem is not None:
            with contextlib.suppress(Exception):  # the mapping goes with the process anyway
                mem.close()


class CudaIpcChannel(ShmChannel):
    """Every cuda-ipc slot this client holds with one replica."""

    name = dp.CUDA_IPC
    on_device = True

    def __init__(self, address: str, instance_id: str, device: torch.device) -> None:
        super().__init__(address, instance_id)
        self.device = torch.device(device)
        self.graph_free: list[CudaIpcSlot] = []  # kept for captured calls, not yet taken

    def map_slots(self, sock, lease, fds, layout: dp.Layout) -> None:
        """Read the slots' CUDA IPC handles (the message after FDS on the lease socket)
        and map each slot's host and GPU memory (LeaseError when this process cannot)."""
        msg = sock.recv(16 + cudamem.HANDLE_BYTES * len(fds))
        if msg[:1] == dp.REFUSED:
            raise LeaseError(f"shard refused the lease: {msg[1:].decode(errors='replace')}")
        handles = msg[1:]
        if msg[:1] != dp.HANDLES or len(handles) != cudamem.HANDLE_BYTES * len(fds):
            raise LeaseError("malformed CUDA IPC handles on the lease socket")
        for i, fd in enumerate(fds):
            handle = handles[i * cudamem.HANDLE_BYTES : (i + 1) * cudamem.HANDLE_BYTES]
            try:
                mem = ImportedBuffer(handle, layout.device_bytes, self.device)
            except cudamem.CudaIpcError as e:  # another host's GPU, no IPC in this container
                raise LeaseError(f"cannot map the shard's GPU memory here: {e}") from None
            lease.slots.append(CudaIpcSlot(lease, i, fd, layout, mem))
