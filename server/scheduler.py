"""One worker thread owns the accelerator and does all MLX work.

Requests wait in a bounded queue. Every active generation advances one engine step (a prefill
chunk, a plain target step or a draft-verify cycle) per round, so a long generation cannot starve
a short one; the generations of one model step together, their forwards batched
(dflash_core/batching.py: one drafter and one target forward for all), which changes none of their
tokens. The worker hands each step's output to the request's asyncio queue; a cancelled request is
closed at its next turn (within one step), which frees its caches. An exception fails only its
request.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from dflash_core.batching import step_together

log = logging.getLogger(__name__)


class QueueFullError(Exception):
    pass


class SchedulerStopped(Exception):
    pass


class JobTimedOut(Exception):
    """A generation still running (or waiting) at its deadline: the worker ends it there, whether
    or not its client is reading (a stream nobody reads is never awaited, so the reader cannot)."""


@dataclass
class Job:
    """One request's generation. `start` runs on the worker thread and returns the step iterator
    (typically `engine.generate(...)`); its items are delivered to `outputs` in order, followed by
    None at the end or the exception that ended it."""

    start: Callable[[], Iterator[Any]]
    loop: asyncio.AbstractEventLoop
    # The engine the job runs on (its memory per token decides admission), and whether `start`
    # returns its batched stream (`generate(..., batched=True)`), stepped with the engine's other
    # such jobs. Without an engine, or not together: an iterator of chunks, stepped alone.
    engine: Any = None
    together: bool = False
    tokens: int = 0  # the most tokens its caches will hold (prompt + max_tokens): its memory's measure
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.perf_counter)
    deadline: Optional[float] = None  # time.perf_counter() past which the worker ends it (None: never)
    steps: Optional[Iterator[Any]] = None

    def cancel(self) -> None:
        self.cancelled.set()

    def _deliver(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline


class Scheduler:
    def __init__(self, *, queue_size: int = 64, max_active: int = 8, memory_fraction: Optional[float] = None,
                 memory_size: Optional[int] = None, batching: bool = False):
        self.queue_size = queue_size
        self.batching = batching  # whether the server's jobs come with their engine, to step together
        self.max_active = max_active
        # Admission by memory (None: by max_active only): the device's memory (or `memory_size`).
        self.memory_budget = None if memory_fraction is None else int(memory_fraction * (memory_size or _device_memory()))
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: list[Job] = []
        # (run, fail) pairs: fail(error) answers the caller when the worker will never run it.
        self._tasks: collections.deque[tuple[Callable[[], None], Callable[[BaseException], None]]] = collections.deque()
        self._wake = threading.Condition()
        self._stopping = False
        self.failure: Optional[str] = None  # set if the worker thread itself died
        self._finished: collections.deque[float] = collections.deque(maxlen=64)  # when generations ended
        self._thread = threading.Thread(target=self._run, name="dflash-worker", daemon=True)

    # ---------------------------------------------------------------- called from the server
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=timeout)

    def abort(self, reason: str) -> None:
        """End every queued and running generation now with SchedulerStopped(reason) (a drain
        past its deadline); the worker frees their caches at its next turn."""
        with self._wake:
            jobs = self._active + list(self._waiting)
        for job in jobs:
            job.cancel()
            job._deliver(SchedulerStopped(reason))

    @property
    def idle(self) -> bool:
        with self._wake:
            return not (self._active or self._waiting)

    def submit(self, job: Job) -> None:
        with self._wake:
            if self._stopping or self.failure:
                raise SchedulerStopped(self.failure or "the server is shutting down")
            self._drop_cancelled_or_expired()  # clients that gave up (or ran out of time) hold no queue slot
            if len(self._waiting) >= self.queue_size:
                raise QueueFullError(f"{len(self._waiting)} requests are already waiting")
            self._waiting.append(job)
            self._wake.notify()

    def call(self, fn: Callable[[], Any]) -> "asyncio.Future":
        """Run `fn` on the worker thread between steps (model loading, for instance)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def fail(error: BaseException) -> None:
            loop.call_soon_threadsafe(_set_exception, future, error)

        def task():
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                fail(e)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        with self._wake:
            if self._stopping or self.failure:  # nobody would ever run it
                future.set_exception(SchedulerStopped(self.failure or "the server is shutting down"))
                return future
            self._tasks.append((task, fail))
            self._wake.notify()
        return future

    def estimated_wait(self) -> float:
        """Seconds until the queue has room again, from the rate at which generations finished
        lately (1 s when there is no history yet)."""
        with self._wake:
            finished, waiting = list(self._finished), len(self._waiting)
        if len(finished) < 2 or finished[-1] <= finished[0]:
            return 1.0
        rate = (len(finished) - 1) / (finished[-1] - finished[0])  # generations a second
        return max(1.0, (waiting - self.queue_size + 1 + len(self._active)) / rate)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return len(self._active)

    def _drop_cancelled_or_expired(self) -> None:
        """Clients that gave up, and jobs past their deadline, leave the queue (and are answered)."""
        now = time.perf_counter()
        for job in [j for j in self._waiting if j.cancelled.is_set() or j.expired(now)]:
            self._waiting.remove(job)
            job._deliver(None if job.cancelled.is_set() else JobTimedOut("waited past the deadline"))

    # ---------------------------------------------------------------- the worker thread
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a bug in the worker itself: fail everything, loudly
            log.exception("the worker thread died")
            self.failure = f"the worker thread died: {type(e).__name__}: {e}"
            for job in self._active + list(self._waiting):
                try:
                    job._deliver(SchedulerStopped(self.failure))
                except Exception:  # noqa: BLE001 - the event loop may be gone
                    pass
        finally:
            with self._wake:
                pending, self._tasks = list(self._tasks), collections.deque()
            for _, fail in pending:
                try:
                    fail(SchedulerStopped(self.failure or "the server is shutting down"))
                except Exception:  # noqa: BLE001 - the event loop may be gone
                    pass
            # MLX gives each thread its own streams, each with a thread of its own, and leaves
            # destroying them to the thread that made them: left to the process's exit, a worker
            # thread's stream was seen aborting it ("terminate called without an active exception").
            import mlx.core as mx

            mx.clear_streams()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._waiting or self._active or self._tasks):
                    self._wake.wait()
                if self._stopping:
                    break
                tasks = list(self._tasks)
                self._tasks.clear()
                self._drop_cancelled_or_expired()
                while self._waiting and len(self._active) < self.max_active and self._fits(self._waiting[0]):
                    self._active.append(self._waiting.popleft())
            for task, _ in tasks:
                task()
            self._round()
        for job in self._active + list(self._waiting):
            self._finish(job, SchedulerStopped("the server is shutting down"))

    def _fits(self, job: Job) -> bool:
        """Whether the job's caches fit beside what is in use now. The first active job always
        starts (its own limit is the model's max_context); jobs behind a large one wait in order."""
        if self.memory_budget is None or not self._active or job.engine is None:
            return True
        per_token = getattr(job.engine, "cache_bytes_per_token", None)
        if not per_token:
            return True  # nothing measured yet: the first generations of a model tell
        import mlx.core as mx

        return mx.get_active_memory() + per_token * job.tokens <= self.memory_budget

    def _round(self) -> None:
        """One step of every active job: those of one engine together, the others alone."""
        together: dict[int, tuple[Any, list[Job]]] = {}
        now = time.perf_counter()
        for job in list(self._active):
            if job.cancelled.is_set():
                self._finish(job, None)
            elif job.expired(now):
                self._finish(job, JobTimedOut("ran past the deadline"))
            elif job.engine is None or not job.together:
                self._step(job)
            elif self._started(job):
                together.setdefault(id(job.engine), (job.engine, []))[1].append(job)
        for engine, jobs in together.values():
            try:
                results = step_together(engine, [job.steps for job in jobs])
            except Exception as e:  # a batched forward failed: every row in it fails, the worker goes on
                log.exception("a batched step failed")
                for job in jobs:
                    self._finish(job, e)
                continue
            chunks: list[tuple[Job, Any]] = []
            for job, result in zip(jobs, results):
                if result.error is not None:
                    log.error("generation failed", exc_info=result.error)
                    self._finish(job, result.error)
                elif result.done:
                    self._finish(job, None)
                else:
                    chunks.append((job, result.chunk))
            _deliver_together(chunks)

    def _started(self, job: Job) -> bool:
        if job.steps is not None:
            return True
        try:
            job.steps = job.start()
        except Exception as e:  # the request's own validation (a 400), or a bug: it fails alone
            if not isinstance(e, ValueError):
                log.exception("generation failed")
            self._finish(job, e)
            return False
        return True

    def _step(self, job: Job) -> None:
        try:
            if job.steps is None:
                job.steps = job.start()
            item = next(job.steps)
        except StopIteration:
            self._finish(job, None)
            return
        except Exception as e:  # one request's failure must not take the worker down
            log.exception("generation failed")
            self._finish(job, e)
            return
        job._deliver(item)

    def _finish(self, job: Job, end: Optional[BaseException]) -> None:
        if job.steps is not None:
            try:
                job.steps.close()  # frees the generation's caches now, not at garbage collection
            except Exception:  # noqa: BLE001
                log.exception("closing a generation failed")
            job.steps = None
        if job in self._active:
            self._active.remove(job)
            self._finished.append(time.perf_counter())
        job._deliver(end)


def _deliver_together(items: list[tuple[Job, Any]]) -> None:
    """Hand a batched step's chunks to their requests with one wake-up of each event loop. One
    `call_soon_threadsafe` per job (a write to the loop's self-pipe and a pass of the loop apiece)
    was event-loop work per row per step, on the cores the engine and the clients share."""
    by_loop: dict[int, tuple[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]]] = {}
    for job, item in items:
        by_loop.setdefault(id(job.loop), (job.loop, []))[1].append((job.outputs, item))
    for loop, puts in by_loop.values():
        loop.call_soon_threadsafe(_put_all, puts)


def _put_all(puts: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in puts:
        queue.put_nowait(item)


def _device_memory() -> int:
    import mlx.core as mx

    return int(mx.device_info().get("memory_size", 0)) or 1 << 40


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
