"""The cross-host data plane's shared pieces: loading NIXL, one agent per process
side, the call and answer notifications, the progress thread and the transfer
handles a slot keeps.

Both ends use these: the shard server (server/remote.py) and the client
(client/nixl.py). docs/dataplane.md ("Across hosts: NIXL") describes the protocol;
in short, each side registers one region per slot, laid out as a same-host slot
(expertd/dataplane.py, Layout), and a call is:

    client: rows into its slot's input regions, then one NIXL WRITE of them (m
            rows) into the shard's slot, with a CALL notification carrying the
            routes (ids, weights) when small, else the WRITE carries them too;
    shard:  on the notification (delivered after the data), the normal checks and
            batching; the partial into its slot's output region, then one NIXL WRITE
            of it into the client's slot, with an ANSWER notification (sequence
            number, status, timing; an error is an ANSWER alone, with its text).

NIXL (PyPI nixl-cu13, module nixl_cu13) is optional: the extra `expertd[nixl]`.
`load()` imports it on first use; without it the data plane is not offered.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from expertd import dataplane as dp
from expertd.tracing import NO_CONTEXT

log = logging.getLogger("expertd.nixl")

NIXL = "nixl"
MODULE = "nixl_cu13"
HOST = "DRAM"
DEVICE = "VRAM"  # GPU memory: regions carry their GPU's index (device_id)

CALL = b"C"
ANSWER = b"A"
# CALL: slot, seq, layer, m, k (u32), timeout_us, request_id (u64), then the caller's
# span: trace_hi, trace_lo, span_id (u64; 0: none), trace_flags (u32)
# (expertd.tracing.context_fields)
_CALL = struct.Struct("<5I2Q3QI")
# A CALL whose routes take at most ROUTES_INLINE bytes carries them after its fields
# (ids int32 [m, k], then weights fp32 [m, k]); its WRITE then moves x alone, and a
# GPU slot's routes make no trip through GPU memory at either end
ROUTES_INLINE = 16384
# ANSWER: slot, seq (u32), status (i32), out_rows (u32), queue, compute, total, stage,
# device (u64, us), batch_requests, batch_tokens (u32); then the error text (UTF-8)
_ANSWER = struct.Struct("<2IiI5Q2I")
ERROR_BYTES = 1024
TIMING = ("queue_us", "compute_us", "total_us", "stage_us", "device_us")
BATCH = ("batch_requests", "batch_tokens")

_module = None
_why = ""
_lock = threading.Lock()


def load():
    """The nixl_cu13 module, or None (`why()` says why); imported once."""
    global _module, _why
    with _lock:
        if _module is None and not _why:
            try:
                import nixl_cu13

                _module = nixl_cu13
            except Exception as e:  # ImportError, or its native libraries failing to load
                _why = f"{MODULE} is not importable ({e}); install expertd[nixl]"
        return _module


def why() -> str:
    return _why


def available() -> bool:
    return load() is not None


def installed() -> bool:
    """Is NIXL there to import (without importing it: a server decides at start what
    it offers, and imports it on the first registration)?"""
    if _module is not None:
        return True
    if _why:
        return False
    import importlib.util

    try:
        return importlib.util.find_spec(MODULE) is not None
    except (ImportError, ValueError):
        return False


def make_agent(role: str):
    """A NIXL agent with the UCX backend (UCX picks the transport: RDMA, NVLink,
    shared memory or TCP). Calls from several threads are serialized by NIXL; there
    is no progress thread (the Progress thread below drives it)."""
    nixl = load()
    if nixl is None:
        raise RuntimeError(_why)
    config = nixl.nixl_agent_config(
        enable_prog_thread=False,
        backends=["UCX"],
        sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    with _quiet():
        agent = nixl.nixl_agent(f"expertd-{role}-{uuid.uuid4().hex[:16]}", config)
    if "UCX" not in agent.backends:
        raise RuntimeError("NIXL has no UCX backend here")
    return agent


@contextlib.contextmanager
def _quiet():
    """NIXL logs every agent's start at INFO; keep that out of the product's logs."""
    logger = logging.getLogger("nixl")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def pack_call(
    slot: int,
    seq: int,
    layer: int,
    m: int,
    k: int,
    timeout_us: int,
    rid: int,
    trace=NO_CONTEXT,
    routes: bytes = b"",
):
    """trace: the caller's span as expertd.tracing.context_fields gives it; routes:
    the call's ids and weights (`inline_routes`), or b"" when the WRITE carries them."""
    fields = _CALL.pack(slot, seq, layer, m, k, timeout_us, rid & (2**64 - 1), *trace)
    return CALL + fields + routes


def routes_inline(m: int, k: int) -> bool:
    """Do a call's routes travel in its CALL notification?"""
    return 0 < 8 * m * k <= ROUTES_INLINE


def inline_routes(ids, w) -> bytes:
    """ids [m, k] and weights [m, k] (numpy) as a CALL carries them."""
    return (
        np.ascontiguousarray(ids, np.int32).tobytes()
        + np.ascontiguousarray(w, np.float32).tobytes()
    )


def call_routes(msg: bytes, m: int, k: int):
    """The routes a CALL carries -> (ids int32 [m, k], weights fp32 [m, k]) numpy
    copies, or None when it carries none; ValueError when its length fits neither."""
    extra = len(msg) - 1 - _CALL.size
    if extra == 0:
        return None
    if extra != 8 * m * k or not routes_inline(m, k):
        raise ValueError("malformed call notification")
    start = 1 + _CALL.size
    ids = np.frombuffer(msg, np.int32, m * k, start).reshape(m, k).copy()
    w = np.frombuffer(msg, np.float32, m * k, start + 4 * m * k).reshape(m, k).copy()
    return ids, w


def unpack_call(msg: bytes) -> tuple:
    """-> (slot, seq, layer, m, k, timeout_us, request_id, trace_hi, trace_lo, span_id,
    trace_flags); ValueError when malformed."""
    if msg[:1] != CALL or len(msg) < 1 + _CALL.size:
        raise ValueError("malformed call notification")
    return _CALL.unpack_from(msg, 1)


def pack_answer(slot: int, seq: int, status: int, rows: int, timing: dict, error: str = ""):
    fields = [int(timing.get(name, 0)) for name in TIMING + BATCH]
    text = error.encode("utf-8", "replace")[:ERROR_BYTES]
    return ANSWER + _ANSWER.pack(slot, seq, status, rows, *fields) + text


def unpack_answer(msg: bytes):
    """-> (slot, seq, status, rows, timing dict, error text); ValueError when malformed."""
    if msg[:1] != ANSWER or len(msg) < 1 + _ANSWER.size:
        raise ValueError("malformed answer notification")
    slot, seq, status, rows, *fields = _ANSWER.unpack_from(msg, 1)
    timing = dict(zip(TIMING + BATCH, fields, strict=True))
    text = msg[1 + _ANSWER.size :].decode("utf-8", "replace")
    return slot, seq, status, rows, timing, text


def _fine_timer() -> None:
    """Let this thread's short sleeps end on time: Linux rounds a normal thread's
    timed sleeps up by its timer slack (50 us by default), longer than the polls."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK: 1 us


class Progress:
    """Drives an agent: reads new notifications (handing each to
    `on_notif(agent_name, message)`) and checks the transfers this side posted (UCX
    sends a transfer's notification once a check finds it complete; `on_done` gets
    "DONE" or "ERR").

    Its thread polls without sleeping for SPIN_S after any activity, then often while
    an answer is awaited, and otherwise sleeps in naps, so an idle shard costs little
    CPU. With `keep_pace` (a shard with spare CPUs, as its shm waiters) it also keeps
    the pace of calls that come at a steady rate (a decode loop's layers, the
    caller's own work between them): it sleeps until dp.NEXT_EARLY_S before the next
    call is due (the shortest recent quiet time that ended in a call, if under
    dp.NEXT_MAX_S), then polls without sleeping, instead of being in a nap when it comes.
    A thread that waits for an answer can drive the agent itself (`drive`): it
    sees its answer without a hand-over from this thread, which meanwhile stays out of
    the way (two threads polling one agent take the interpreter lock from each other).
    """

    # after any activity: poll without sleeping for SPIN_S (yielding the interpreter
    # lock between passes), then for HOT_S every POLL_S at first, then every 1/50 of
    # the time since the activity (a stream of calls is caught at once; quiet costs less)
    SPIN_S = 100e-6
    HOT_S = 2e-3
    POLL_S = 20e-6
    # while an expected answer is out (expect()), past HOT_S: poll every 1/50 of the
    # time waited so far, at most WAIT_POLL_S (a late answer is seen within ~2%)
    WAIT_POLL_S = 200e-6
    NAP_S = 100e-6  # then naps, doubling up to MAX_NAP_S
    MAX_NAP_S = 1e-3
    DRIVEN_NAP_S = 1e-3  # the thread's naps while a caller drives the agent

    def __init__(
        self,
        agent,
        on_notif: Callable[[str, bytes], None],
        name: str,
        keep_pace: bool = False,
        wake_port: WakePort | None = None,
    ) -> None:
        """wake_port (a shard's): the thread also wakes from its naps, and polls as after
        any activity, on a datagram of a live lease's token there."""
        self.agent = agent
        # quiet times that ended in a notification (a call's arrival), when keeping pace
        self.gaps = dp.Recent() if keep_pace else None
        self._arrivals = 0  # notifications taken so far
        self.on_notif = on_notif
        # (handle, on_done, kept): transfers posted and not yet seen complete
        self._posted: list[tuple[object, Callable[[str], None] | None, bool]] = []
        self._expected: dict[object, float] = {}  # what answers are awaited, until when
        self._lock = threading.Lock()
        self._polling = threading.Lock()  # one pass over the agent at a time
        self._drivers = 0  # callers driving the agent now (drive())
        self._wake = _Sleeper(wake_port)
        self._stop = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def send(self, handle, peer: str, notif: bytes, on_done=None, wake=True, kept=False):
        """Post the transfer `handle` (from initialize_xfer) with this notification;
        kept: a handle of a Handles cache, posted again (not released once complete);
        wake=False: the caller drives the agent next (drive()), the thread sleeps on."""
        state = self.agent.transfer(handle, notif)
        if state == "ERR":
            if not kept:
                self.agent.release_xfer_handle(handle)
            raise ConnectionError(f"NIXL transfer to {peer} failed to start")
        with self._lock:
            self._posted.append((handle, on_done, kept))
        if wake and not self._drivers:
            self._wake.set()

    def idle(self, handle) -> bool:
        """No transfer of `handle` is under way (one found complete now is finished
        here), so it may be posted again."""
        with self._lock:
            entry = next((e for e in self._posted if e[0] is handle), None)
        if entry is None:
            return True
        try:
            state = self.agent.check_xfer_state(handle)
        except Exception:
            state = "ERR"
        if state == "PROC":
            return False
        self._finish(entry, state)
        return True

    def _finish(self, entry, state: str) -> None:
        """A posted transfer ended: whichever thread takes it off the list first
        releases its handle (unless kept) and tells its owner."""
        with self._lock:
            for i, e in enumerate(self._posted):
                if e is entry:
                    del self._posted[i]
                    break
            else:
                return
        handle, on_done, kept = entry
        if not kept:
            with contextlib.suppress(Exception):
                self.agent.release_xfer_handle(handle)
        if on_done is not None:
            try:
                on_done(state)
            except Exception:
                log.exception("NIXL transfer completion")

    def expect(self, key, deadline: float) -> None:
        """An answer for `key` is awaited until `deadline` (time.monotonic()): poll
        for it however long it takes (see WAIT_POLL_S)."""
        with self._lock:
            self._expected[key] = deadline
        self._wake.set()

    def settle(self, key) -> None:
        """The answer for `key` came, or is no longer awaited."""
        with self._lock:
            self._expected.pop(key, None)

    def _awaited(self, now: float) -> bool:
        with self._lock:
            late = [k for k, d in self._expected.items() if d <= now]
            for k in late:
                del self._expected[k]
            return bool(self._expected)

    def notify(self, peer: str, message: bytes, wake=True) -> None:
        self.agent.send_notif(peer, message)
        if wake and not self._drivers:
            self._wake.set()

    def drive(self, done: Callable[[], bool], until: float) -> bool:
        """Poll the agent on this thread until done() (-> True) or time.monotonic()
        reaches `until` (-> done()), yielding the interpreter lock and the CPU between passes."""
        with self._lock:
            self._drivers += 1
        try:
            while not done():
                if time.monotonic() >= until or self._stop:
                    return done()
                self.poll()
                os.sched_yield()
            return True
        finally:
            with self._lock:
                self._drivers -= 1
                left = bool(self._posted or self._expected)
            if left:  # the thread takes over what is still out
                self._wake.set()

    def poll(self) -> bool:
        """One pass over the agent (any thread; False at once while another thread
        makes one) -> whether anything came or completed."""
        if not self._polling.acquire(blocking=False):
            return False
        try:
            return self._pass()
        finally:
            self._polling.release()

    def _pass(self) -> bool:
        agent = self.agent
        busy = False
        try:
            notifs = agent.get_new_notifs()
        except Exception as e:  # a peer's connection broke: its calls fail elsewhere
            log.debug("NIXL notifications: %s", e)
            notifs = {}
        for peer, messages in notifs.items():
            for message in messages:
                busy = True
                self._arrivals += 1
                try:
                    self.on_notif(peer, message)
                except Exception:
                    log.exception("NIXL notification from %s", peer)
        with self._lock:
            posted = list(self._posted)
        if posted:
            busy = True
            for entry in posted:
                try:
                    state = agent.check_xfer_state(entry[0])
                except Exception:
                    state = "ERR"
                if state != "PROC":
                    self._finish(entry, state)
        return busy

    def _run(self) -> None:
        _fine_timer()
        idle_since = time.monotonic()
        nap = self.NAP_S
        gaps = self.gaps
        while not self._stop:
            if self._drivers:  # a caller polls: stay out of its way
                self._wake.sleep(self.DRIVEN_NAP_S)
                idle_since, nap = time.monotonic(), self.NAP_S  # then poll as if busy
                continue
            began, arrivals = time.monotonic(), self._arrivals
            busy = self.poll()
            now = time.monotonic()  # after the pass: a forward may have run in it
            if busy:
                # a call's arrival after a quiet time (not a transfer of its own ending)
                quiet = began - idle_since
                if gaps is not None and self._arrivals != arrivals and quiet > self.SPIN_S:
                    gaps.add(quiet)
                idle_since, nap = now, self.NAP_S
                continue
            quiet = now - idle_since
            if quiet < self.SPIN_S:
                os.sched_yield()
                continue
            due = gaps.low() if gaps is not None else 0.0
            if 0.0 < due < dp.NEXT_MAX_S and quiet < due + dp.NEXT_SPIN_S:
                if quiet < due - dp.NEXT_EARLY_S:  # asleep until shortly before it is due
                    rung = self._wake.sleep(due - dp.NEXT_EARLY_S - quiet)
                else:
                    os.sched_yield()
                    continue
            elif quiet < self.HOT_S or self._awaited(now):
                rung = self._wake.sleep(min(max(self.POLL_S, quiet / 50), self.WAIT_POLL_S))
            else:
                rung = self._wake.sleep(nap)
                nap = min(nap * 2, self.MAX_NAP_S)
            if rung:  # a caller's datagram: its CALL is on the way, poll as after activity
                idle_since, nap = time.monotonic(), self.NAP_S

    def stop(self, wait: bool = True) -> None:
        """End the thread; wait (at most 2 s) for it unless told not to."""
        self._stop = True
        self._wake.set()
        if wait and threading.current_thread() is not self.thread:
            self.thread.join(timeout=2)


class WakePort:
    """A shard's UDP port where a remote caller wakes its progress thread: after posting
    a CALL's WRITE the caller sends its lease's token here (client/nixl.py), so a shard
    whose thread is in its naps (quiet for more than Progress.HOT_S) polls at once
    rather than up to MAX_NAP_S later. A datagram carries no data and is only a hint:
    one holding no live token is dropped, a lost one costs the nap."""

    TOKEN_BYTES = 16

    def __init__(self, host: str | None = None, port: int = 0) -> None:
        """host: where to bind (the gRPC listen address's host; None: every interface),
        port: which UDP port (0: any free one)."""
        family, _, _, _, where = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_DGRAM, flags=socket.AI_PASSIVE
        )[0]
        self.sock = socket.socket(family, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            self.sock.bind(where)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self._tokens: set[bytes] = set()
        self.rung = 0  # datagrams that held a live token

    def new_token(self) -> bytes:
        token = secrets.token_bytes(self.TOKEN_BYTES)
        self._tokens.add(token)
        return token

    def drop(self, token: bytes) -> None:
        self._tokens.discard(token)

    def drain(self) -> bool:
        """Read every datagram waiting -> whether one held a live token."""
        rung = False
        while True:
            try:
                data = self.sock.recv(64)
            except (BlockingIOError, InterruptedError):
                return rung
            except OSError:  # closed
                return rung
            if data in self._tokens:
                self.rung += 1
                rung = True

    def close(self) -> None:
        self.sock.close()


class _Sleeper:
    """Where a progress thread sleeps between passes: woken by set() (a thread of this
    process posted something) or, with a WakePort, by a live token's datagram."""

    def __init__(self, port: WakePort | None) -> None:
        self.port = port
        self._event = threading.Event() if port is None else None
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) if port is not None else -1

    def set(self) -> None:
        if self._event is not None:
            self._event.set()
        else:
            os.eventfd_write(self._fd, 1)

    def sleep(self, timeout: float) -> bool:
        """Sleep until set(), a live token's datagram or `timeout` s -> whether a token
        rang (other datagrams are read and slept through)."""
        if self._event is not None:
            self._event.wait(timeout)
            self._event.clear()
            return False
        port = self.port
        end = time.monotonic() + timeout
        while True:
            try:
                ready, _, _ = select.select(
                    [self._fd, port.sock], [], [], max(end - time.monotonic(), 0.0)
                )
            except (OSError, ValueError):  # the port closed under a stopping thread
                return False
            if self._fd in ready:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._fd)
                return port.sock in ready and port.drain()
            if not ready:
                return False
            if port.drain():
                return True


class Handles:
    """One slot's transfer handles, kept by the call's shape and posted again with
    each call's notification: a call then builds no descriptor lists and no handle
    (NIXL lets a handle be re-posted once its last transfer is complete). At most
    KEEP per slot; a shape whose handle is still under way, or that finds every kept
    one busy, gets a handle of its own for the call."""

    KEEP = 4

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self._kept: OrderedDict[object, object] = OrderedDict()

    def send(
        self, key, make: Callable[[], object], peer: str, notif: bytes, on_done=None, wake=True
    ):
        """Post the transfer of shape `key` (make() builds its handle when none is
        kept) with this notification."""
        progress = self.progress
        handle = self._kept.get(key)
        if handle is not None and progress.idle(handle):
            self._kept.move_to_end(key)
            progress.send(handle, peer, notif, on_done, wake, kept=True)
            return
        if handle is None and len(self._kept) >= self.KEEP:
            old_key, old = next(iter(self._kept.items()))
            if progress.idle(old):
                del self._kept[old_key]
                with contextlib.suppress(Exception):
                    progress.agent.release_xfer_handle(old)
        kept = handle is None and len(self._kept) < self.KEEP
        fresh = make()
        if kept:
            self._kept[key] = fresh
        progress.send(fresh, peer, notif, on_done, wake, kept=kept)

    def close(self) -> None:
        """Release every kept handle (the lease is over: none is posted again)."""
        kept, self._kept = list(self._kept.values()), OrderedDict()
        for handle in kept:
            with contextlib.suppress(Exception):
                self.progress.agent.release_xfer_handle(handle)
