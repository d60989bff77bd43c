"""An asyncio event loop on a thread of its own, for the sync client and the background server.

grpc.aio binds every event loop that uses it to one process-wide completion queue and wakes all
of them on each event; the loops that lose the race raise BlockingIOError in
PollerCompletionQueue._handle_events, and asyncio's default handler logs that as an error
although nothing failed (grpc/grpc#25364). A process that holds the sync client beside a
server, or beside the caller's own asyncio application, has several such loops, so the loops
started here drop exactly that error and pass every other one to asyncio's default handler.
"""

from __future__ import annotations

import asyncio
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


def start_loop_thread(name: str) -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    """A new event loop (quiet_grpc_wakeups) running forever on a new daemon thread `name`."""
    loop = asyncio.new_event_loop()
    quiet_grpc_wakeups(loop)
    thread = threading.Thread(target=loop.run_forever, name=name, daemon=True)
    thread.start()
    return loop, thread
