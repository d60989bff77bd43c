"""The event loops the sync client and the background server run on: grpc.aio's spurious
wake-up error (several loops bound to one completion queue, grpc/grpc#25364) is dropped, every
other error still reaches asyncio's log; stopping a loop ends its tasks first and leaves it
open, so an event grpc.aio delivers to it later waits there instead of raising "Event loop is
closed" in another loop; a stopped loop is reused; a shared loop is started once per name and
runs until the process ends."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading

import pytest

from expertd.aioloop import (
    is_spurious_grpc_wakeup,
    quiet_grpc_wakeups,
    run,
    shared_loop,
    start_loop_thread,
    stop_loop_thread,
)

SPURIOUS = {
    "message": "Exception in callback PollerCompletionQueue._handle_events(<_UnixSelectorEventLoop"
    " running=True closed=False debug=False>)()",
    "exception": BlockingIOError(11, "Resource temporarily unavailable"),
}


def test_only_the_pollers_blocking_io_error_is_spurious():
    assert is_spurious_grpc_wakeup(SPURIOUS)
    assert not is_spurious_grpc_wakeup({**SPURIOUS, "exception": RuntimeError("real")})
    assert not is_spurious_grpc_wakeup({**SPURIOUS, "message": "Exception in callback mine()"})
    assert not is_spurious_grpc_wakeup({"message": "Task was destroyed but it is pending!"})


def test_loop_thread_drops_the_spurious_error_and_logs_the_rest(caplog):
    loop, thread = start_loop_thread("expertd-test")
    try:
        assert thread.is_alive() and thread.name == "expertd-test"

        async def report(context):
            asyncio.get_running_loop().call_exception_handler(context)

        with caplog.at_level(logging.ERROR, logger="asyncio"):
            asyncio.run_coroutine_threadsafe(report(SPURIOUS), loop).result(5)
            assert not caplog.records
            real = {"message": "Exception in callback mine()", "exception": ValueError("boom")}
            asyncio.run_coroutine_threadsafe(report(real), loop).result(5)
        assert [r.getMessage() for r in caplog.records] == ["Exception in callback mine()"]
    finally:
        stop_loop_thread(loop, thread)


def test_an_applications_own_loop_can_be_quieted(caplog):
    loop = asyncio.new_event_loop()
    try:
        quiet_grpc_wakeups(loop)
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            loop.call_exception_handler(SPURIOUS)
            assert not caplog.records
            loop.call_exception_handler({"message": "other", "exception": OSError("x")})
        assert [r.getMessage() for r in caplog.records] == ["other"]
    finally:
        loop.close()


def test_stopping_a_loop_thread_ends_its_tasks_first(caplog):
    loop, thread = start_loop_thread("expertd-test")

    async def start_waiter():  # a task that would wait forever (as grpc.aio's status waiters)
        return asyncio.ensure_future(asyncio.sleep(3600))

    task = asyncio.run_coroutine_threadsafe(start_waiter(), loop).result(5)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        stop_loop_thread(loop, thread)
        assert task.cancelled()
        assert not thread.is_alive() and not loop.is_running() and not loop.is_closed()
        del task
        gc.collect()
    assert not caplog.records  # no "Task was destroyed but it is pending!"
    stop_loop_thread(loop, thread)  # stopping it again does nothing
    again, thread2 = start_loop_thread("expertd-test")
    assert again is loop  # the stopped loop, running again
    stop_loop_thread(again, thread2)


def test_an_event_for_a_stopped_loop_waits_for_it_to_run_again():
    """What grpc.aio's poller does with a completion that arrives after the loop's server or
    client stopped: call_soon_threadsafe from another thread. It must not raise, and the
    callback runs once the loop runs again."""
    loop, thread = start_loop_thread("expertd-test")
    stop_loop_thread(loop, thread)
    ran = threading.Event()
    delivered = []

    def deliver():
        loop.call_soon_threadsafe(ran.set)  # raised "Event loop is closed" on a closed loop
        delivered.append(True)

    poller = threading.Thread(target=deliver)
    poller.start()
    poller.join(5)
    assert delivered == [True] and not ran.is_set()
    again, thread = start_loop_thread("expertd-test")
    assert again is loop and ran.wait(5)
    stop_loop_thread(again, thread)


def test_run_returns_the_result_ends_other_tasks_and_leaves_the_loop_open():
    state = {}

    async def main():
        state["loop"] = asyncio.get_running_loop()
        state["left"] = asyncio.ensure_future(asyncio.sleep(3600))
        return 42

    assert run(main()) == 42
    assert state["left"].cancelled()
    assert not state["loop"].is_closed() and not state["loop"].is_running()

    async def fail():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        run(fail())


def test_shared_loop_is_one_running_loop_per_name_restarted_if_its_thread_died():
    a = shared_loop("expertd-test-shared")
    assert shared_loop("expertd-test-shared") is a
    assert shared_loop("expertd-test-other") is not a

    async def where():
        return asyncio.get_running_loop()

    assert asyncio.run_coroutine_threadsafe(where(), a).result(5) is a
    # its thread gone (as in a forked child): the next caller gets a running loop again
    thread = next(t for t in threading.enumerate() if t.name == "expertd-test-shared")
    stop_loop_thread(a, thread)
    b = shared_loop("expertd-test-shared")
    assert asyncio.run_coroutine_threadsafe(where(), b).result(5) is b and b.is_running()
    assert shared_loop("expertd-test-shared") is b
