"""Asyncio event loops on threads of their own, for the sync client and the background server.

The sync clients share one loop that is never closed (shared_loop): grpc.aio delivers the
events of every loop of a process from one poller, and an event for a closed loop raises
there ("Event loop is closed") and leaves the events queued behind it until the next
wake-up. A loop that is closed (stop_loop_thread: the background server's) ends its tasks
first, as asyncio.run does: grpc.aio leaves a task per stream call awaiting the call's
status, and a loop closed with such tasks pending logs "Task was destroyed but it is
pending!" once for each (the sync client, when each had its own loop, logged one per shard
stream at every close).

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


def start_loop_thread(name: str) -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    """A new event loop (quiet_grpc_wakeups) running forever on a new daemon thread `name`."""
    loop = asyncio.new_event_loop()
    quiet_grpc_wakeups(loop)
    thread = threading.Thread(target=loop.run_forever, name=name, daemon=True)
    thread.start()
    return loop, thread


async def _end_other_tasks(timeout: float) -> None:
    """Cancel every task of the running loop but this one and wait (up to `timeout`) for them
    to end; then close its async generators."""
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)
    await asyncio.get_running_loop().shutdown_asyncgens()


def stop_loop_thread(
    loop: asyncio.AbstractEventLoop, thread: threading.Thread, timeout: float = 10.0
) -> None:
    """Stop a loop of start_loop_thread: end its tasks (_end_other_tasks), stop it, join its
    thread and close it. Call from another thread; a closed loop is left as it is."""
    if loop.is_closed():
        return
    if thread.is_alive():
        # (a loop that no longer runs times out here: nothing of it runs again anyway)
        with contextlib.suppress(TimeoutError, RuntimeError):
            asyncio.run_coroutine_threadsafe(_end_other_tasks(timeout / 2), loop).result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=timeout)
    loop.close()
