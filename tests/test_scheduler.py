"""The worker thread's contract when it dies: every waiter is answered, nothing hangs."""

from __future__ import annotations

import asyncio
import time

import pytest

from dflash_server.scheduler import Job, JobTimedOut, Scheduler, SchedulerStopped


class Fatal(BaseException):
    """Not an Exception: it escapes the per-request handler and takes the worker down."""


def test_a_dead_worker_answers_every_caller():
    async def scenario():
        scheduler = Scheduler(queue_size=4, max_active=2)
        scheduler.start()
        loop = asyncio.get_running_loop()

        def doomed():
            yield "first"
            raise Fatal("planted")

        job = Job(start=doomed, loop=loop)
        scheduler.submit(job)
        assert await asyncio.wait_for(job.outputs.get(), 10) == "first"
        ended = await asyncio.wait_for(job.outputs.get(), 10)
        assert isinstance(ended, SchedulerStopped) and "Fatal" in str(ended)
        scheduler._thread.join(timeout=10)
        assert "worker thread died" in scheduler.failure
        # A model load queued afterwards fails at once instead of waiting for a worker that is gone.
        with pytest.raises(SchedulerStopped, match="worker thread died"):
            await asyncio.wait_for(scheduler.call(lambda: "loaded"), 10)
        with pytest.raises(SchedulerStopped):
            scheduler.submit(Job(start=doomed, loop=loop))

    asyncio.run(scenario())


def test_stop_answers_queued_calls():
    async def scenario():
        scheduler = Scheduler()
        scheduler.start()
        scheduler.stop()
        with pytest.raises(SchedulerStopped, match="shutting down"):
            await asyncio.wait_for(scheduler.call(lambda: "loaded"), 10)

    asyncio.run(scenario())


def test_retry_after_follows_the_measured_service_rate():
    scheduler = Scheduler(queue_size=4, max_active=1)
    assert scheduler.estimated_wait() == 1.0  # no history yet
    loop = asyncio.new_event_loop()
    try:
        for _ in range(4):  # waiting jobs (the worker is not started)
            scheduler.submit(Job(start=lambda: iter(()), loop=loop))
        # Generations finished two a second lately: four waiting need (4 - 4 + 1) / 2 s at least.
        scheduler._finished.extend([10.0, 10.5, 11.0, 11.5, 12.0])
        assert scheduler.estimated_wait() == 1.0
        scheduler._finished.clear()
        scheduler._finished.extend([10.0, 20.0, 30.0])  # one every 10 s: 10 s until a slot frees
        assert scheduler.estimated_wait() == pytest.approx(10.0)
    finally:
        loop.close()


EXITS_AFTER_QUEUED_WORK = """
import asyncio
import time
import mlx.core as mx
from dflash_server.scheduler import Scheduler

async def main():
    scheduler = Scheduler()
    scheduler.start()

    def queue_work():  # device work still running when the worker thread ends
        a = mx.random.normal((1024, 1024))
        mx.eval(a @ a)
        b = c = mx.random.normal((2048, 2048))
        for _ in range(20):
            c = c @ b / 2048
        mx.async_eval(c)

    await scheduler.call(queue_work)
    scheduler.stop()

asyncio.run(main())
"""


def test_the_process_exits_cleanly_after_the_worker_ran_mlx():
    """MLX gives the worker thread streams of its own, which only that thread may destroy: left to
    the process's exit they aborted it about half the time ("terminate called without an active
    exception", exit status 134) when device work was still queued on them (a thread queueing
    matmuls like these: 2 of 5 runs aborted without `mx.clear_streams()` at its end, 0 of 5 with it)."""
    import subprocess
    import sys

    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", EXITS_AFTER_QUEUED_WORK], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


def test_a_job_is_measured_by_what_its_caches_can_hold():
    """Admission counts a job's tokens as its prompt plus max_tokens, never past the model's context:
    a max_tokens of 2**40 (accepted: the context ends a generation first) must not make a job that
    never fits beside another one, holding back the queue behind it."""
    from dflash_server.generation import _cache_tokens

    assert _cache_tokens(100, 2**40, 4096) == 4096
    assert _cache_tokens(100, 50, 4096) == 150
    assert _cache_tokens(100, None, 4096) == 4096  # no max_tokens: the context bounds it
    assert _cache_tokens(100, 50, None) == 150


def _endless(closed: list):
    def steps():
        try:
            n = 0
            while True:
                n += 1
                yield n
        finally:
            closed.append(True)
    return steps


def test_the_worker_ends_a_generation_at_its_deadline_whether_or_not_it_is_read():
    """A stream whose client stops reading is never awaited, so only the worker can hold the
    request to its timeout: it ends the generation there (and frees it), read or not."""
    async def scenario():
        scheduler = Scheduler(queue_size=4, max_active=1)
        scheduler.start()
        loop = asyncio.get_running_loop()
        closed: list = []
        job = Job(start=_endless(closed), loop=loop, deadline=time.perf_counter() + 0.5)
        scheduler.submit(job)
        # Nobody reads while it runs: wait for the worker to let it go.
        while scheduler.active or scheduler.waiting:
            await asyncio.sleep(0.01)
        items = []
        while not job.outputs.empty():
            items.append(job.outputs.get_nowait())
        assert isinstance(items[-1], JobTimedOut) and closed == [True]
        assert all(isinstance(i, int) for i in items[:-1]) and len(items) > 1

        # One waiting behind a generation without a deadline is answered when its own passes.
        running = Job(start=_endless([]), loop=loop)
        scheduler.submit(running)
        waiting = Job(start=_endless([]), loop=loop, deadline=time.perf_counter() + 0.2)
        scheduler.submit(waiting)
        ended = await asyncio.wait_for(waiting.outputs.get(), 30)
        assert isinstance(ended, JobTimedOut) and "waited" in str(ended)
        assert scheduler.active == 1 and scheduler.waiting == 0
        running.cancel()
        scheduler.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))
