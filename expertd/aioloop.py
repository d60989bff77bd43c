"""Asyncio event loops on threads of their own, for the sync client and the background server.

grpc.aio delivers the events of every event loop of a process from one poller, and an
event for a loop that has been closed raises there ("Event loop is closed"): in the loop
that drained the poller, which logs it, and which leaves the events queued behind it (for
live loops too) until the next wake-up. grpc.aio can owe a loop events after everything on
it has ended: a cancelled call's operations complete in the core shortly after the cancel
(a deadline passed, a client closed, a server stopped). So the loops started here are
never closed. The sync clients share one that runs until the process ends (shared_loop).
A loop stopped with stop_loop_thread (the background server's) ends its tasks first, as
asyncio.run does, and is then kept, stopped but open, for the next start_loop_thread:
an event that arrives for it meanwhile waits on it and runs when it runs again.

grpc.aio binds every event loop that uses it to one process-wide completion queue and wakes all
of them on each event; the loops that lose the race raise BlockingIOError in
PollerCompletionQueue._handle_events, and asyncio's default handler logs that as an error
although nothing failed (grpc/grpc#25364). A process that holds the sync client beside a
server, or beside the caller's own asyncio application, has several such loops, so the loops
started here drop exactly that error and pass every other one to asyncio's default handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading


def is_spurious_grpc_wakeup(context: dict) -> bool:
    """True for the BlockingIOError a grpc.aio poller callback raises when another loop took
    the wake-up byte (harmless); False for anything else."""
    if not isinstance(context.get("exception"), BlockingIOError):
        return False
    where = f"{context.get('message', '')} {context.get('handle', '')!r}"
    return "PollerCompletionQueue" in where


def _exception_handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    if not is_spurious_grpc_wakeup(context):
        loop.default_exception_handler(context)


def quiet_grpc_wakeups(loop: asyncio.AbstractEventLoop) -> None:
    """Give `loop` (e.g. an application's own, beside the sync client's) the handler that drops
    grpc.aio's spurious wake-up error and passes every other error to asyncio's default."""
    loop.set_exception_handler(_exception_handler)


_shared: dict[str, tuple[asyncio.AbstractEventLoop, threading.Thread, int]] = {}
_shared_lock = threading.Lock()


def shared_loop(name: str) -> asyncio.AbstractEventLoop:
    """The process's loop `name` (start_loop_thread): started on first use and never closed, so
    grpc.aio never has an event for a closed loop of ours to deliver (the sync clients share
    "expertd-client"). A forked child starts its own: the parent's thread does not run there."""
    with _shared_lock:
        entry = _shared.get(name)
        if entry is None or entry[2] != os.getpid() or not entry[1].is_alive():
            loop, thread = start_loop_thread(name)
            entry = _shared[name] = (loop, thread, os.getpid())
        return entry[0]


_parked: list[tuple[asyncio.AbstractEventLoop, int]] = []  # stopped, open loops and their pid
_parked_lock = threading.Lock()


def start_loop_thread(name: str) -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    """An event loop (quiet_grpc_wakeups) running forever on a new daemon thread `name`: one
    that stop_loop_thread stopped in this process if there is one, else a new one."""
    loop = None
    with _parked_lock:
        while _parked and loop is None:
            candidate, pid = _parked.pop()
            if pid == os.getpid() and not candidate.is_closed():
                loop = candidate  # (a forked child never runs its parent's loops)
    if loop is None:
        loop = asyncio.new_event_loop()
        quiet_grpc_wakeups(loop)
    thread = threading.Thread(target=loop.run_forever, name=name, daemon=True)
    thread.start()
    return loop, thread


async def _end_other_tasks(timeout: float) -> None:
    """Cancel every task of the running loop but this one and wait (up to `timeout`) for them
    to end."""
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)


def stop_loop_thread(
    loop: asyncio.AbstractEventLoop, thread: threading.Thread, timeout: float = 10.0
) -> None:
    """Stop a loop of start_loop_thread: end its tasks (_end_other_tasks), stop it and join
    its thread. The loop is not closed (grpc.aio may still owe it events): it is kept for
    the next start_loop_thread. Call from another thread, once per start_loop_thread."""
    if loop.is_closed() or not thread.is_alive():
        return
    # (a loop that no longer runs times out here: nothing of it runs again anyway)
    with contextlib.suppress(TimeoutError, RuntimeError):
        asyncio.run_coroutine_threadsafe(_end_other_tasks(timeout / 2), loop).result(timeout)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=timeout)
    if not thread.is_alive():
        with _parked_lock:
            _parked.append((loop, os.getpid()))


def run(coro, name: str = "expertd-run"):
    """Run `coro` to its end as asyncio.run does (its other tasks are cancelled after it),
    on a loop thread of start_loop_thread, and return its result. Unlike asyncio.run, the
    loop is not closed afterwards: for a process with other grpc.aio loops (the sync
    client's, an embedded server's), where grpc.aio can still owe events to the loop of an
    AsyncExpertClient that has just been closed."""
    loop, thread = start_loop_thread(name)
    try:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()
    finally:
        stop_loop_thread(loop, thread)
