"""Worker threads for the host side of the pipeline.

Worker: jobs run in submission order on one thread. DeadlineWorker: jobs that carry a
deadline run earliest-deadline-first among those ready (the host's AdamW jobs: see
its docstring); jobs without one are barriers. Torch releases the GIL inside its
kernels, so casts, copies and AdamW run in parallel with the compute thread. A job
that raises poisons the worker: every later job fails with the same error and
`check()` re-raises it in the caller, so a failure never turns into a hang.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable


POLL_S = 0.002     # DeadlineWorker: how often unannounced readiness is re-checked


def _describe(fn, args) -> str:
    """A job as the watchdog reports it: the engine's timed jobs carry (thread, what, unit, fn)."""
    name = getattr(fn, "__name__", repr(fn))
    if name == "timed" and len(args) >= 3:
        return f"{args[1]} {args[2]}"
    return name


class WorkerError(RuntimeError):
    pass


class Worker:
    def __init__(self, name: str, on_error: Callable[[BaseException, str], None] | None = None):
        self.name = name
        self._on_error = on_error
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self.current: str | None = None    # the job running now (for the watchdog's report)
        self.before_job: Callable[[], None] | None = None   # called before each job (fault injection)
        self.since = 0.0                   # when it started (time.monotonic)
        self._thread = threading.Thread(target=self._run, name=f"slidetune-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args, **kwargs) -> Future:
        fut: Future = Future()
        self._jobs.put((fut, fn, args, kwargs))
        return fut

    def _next(self) -> tuple | None:
        """The next job as (future, fn, args, kwargs); None once closed."""
        return self._jobs.get()

    def _run(self) -> None:
        while (item := self._next()) is not None:
            fut, fn, args, kwargs = item
            if self._error is not None:
                fut.set_exception(WorkerError(f"{self.name} worker failed earlier: {self._error!r}"))
                continue
            self.current, self.since = _describe(fn, args), time.monotonic()
            try:
                if self.before_job is not None:
                    self.before_job()
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - forwarded to the compute thread
                self._error = e
                fut.set_exception(e)
                if self._on_error is not None:
                    self._on_error(e, self.name)
            finally:
                self.current = None

    def check(self) -> None:
        if self._error is not None:
            raise WorkerError(f"{self.name} worker failed: {self._error!r}") from self._error

    def drain(self) -> None:
        """Block until every job submitted so far has run."""
        self.submit(lambda: None).result()
        self.check()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=60)


class _Job:
    __slots__ = ("fut", "fn", "args", "kwargs", "deadline", "ready", "whole", "seq")

    def __init__(self, fut, fn, args, kwargs, deadline, ready, whole, seq):
        self.fut, self.fn, self.args, self.kwargs = fut, fn, args, kwargs
        self.deadline, self.ready, self.whole, self.seq = deadline, ready, whole, seq


class DeadlineWorker(Worker):
    """One thread; among the pending jobs that carry a deadline, the earliest ready one runs next.

    Why (the eager update schedule): the backward releases gradients head, L-1, ..., 0,
    embedding, but the next forward needs the updates in the opposite order. A FIFO host
    thread updates layer 0 and the embedding last, so the next forward starts only once
    every update of the step is done, and the CPU idles through the next forward and the
    head (benchmarks/NOTES.md "Update order"). Earliest deadline first (deadline = position in the next
    forward) updates the most recently released unit first and leaves the upper layers,
    needed late in the next forward, to run while that forward computes.

    Jobs without a deadline are barriers: a barrier runs once every job submitted before it
    has run, and no job submitted after it runs before it (step boundaries, drain()).
    A job runs only once its `ready()` is true (the host's: its first gradient chunk has
    landed); call notify() when readiness may have changed. Among the ready jobs, those
    whose `whole()` is true (the host's: every chunk landed, or the rest is on its way) go
    before the others: a host that took the newest unit while the ring was full would
    free a buffer for its next chunk only by finishing the first, then wait for that copy
    (~4 ms a Qwen3-4B layer in the backward, NOTES.md "Update order"), while whole units sat in the
    ring. A job without `whole` counts as whole. `whole` only orders ready jobs, so it
    cannot hold the worker up. The D2H issuer,
    itself earliest-deadline-first, issues one unit at a time, so a ready job is either
    fully copied or the one being issued, whose consumption frees the ring buffers the
    issuer waits for: no deadlock however small the ring.
    """

    def __init__(self, name: str, on_error: Callable[[BaseException, str], None] | None = None):
        self._cond = threading.Condition()
        self._pending: list[_Job] = []
        self._seq = 0
        self._closing = False
        super().__init__(name, on_error)

    def submit(self, fn: Callable[..., Any], *args, deadline: float | None = None,
               ready: Callable[[], bool] | None = None, whole: Callable[[], bool] | None = None,
               **kwargs) -> Future:
        fut: Future = Future()
        with self._cond:
            self._seq += 1
            self._pending.append(_Job(fut, fn, args, kwargs, deadline, ready, whole, self._seq))
            self._cond.notify_all()
        return fut

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _next(self) -> tuple | None:
        with self._cond:
            while True:
                while not self._pending:
                    if self._closing:
                        return None
                    self._cond.wait()
                job = self._pick_locked()
                if job is not None:
                    return job.fut, job.fn, job.args, job.kwargs

    def _pick_locked(self) -> _Job | None:
        """The next job, or None after a short wait when no eligible job is ready (lock held)."""
        head = self._pending[0]
        if head.deadline is None:                     # a barrier whose predecessors all ran
            return self._pending.pop(0)
        eligible = []
        for job in self._pending:
            if job.deadline is None:
                break
            eligible.append(job)
        ready = [j for j in eligible if j.ready is None or j.ready()]
        if not ready:
            # woken by notify(); the timeout re-checks readiness that nothing announces (a copy
            # landing on the GPU): 2 ms against ~50 ms of AdamW per 8B layer
            self._cond.wait(timeout=POLL_S)
            return None
        whole = [j for j in ready if j.whole is None or j.whole()]
        job = min(whole or ready, key=lambda j: (j.deadline, j.seq))
        self._pending.remove(job)
        return job

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=60)


def wait_or_abort(fut: Future, abort: threading.Event, what: str, poll_s: float = 0.5):
    """Block on `fut` from a pipeline thread, giving up if another thread has failed."""
    while True:
        try:
            return fut.result(timeout=poll_s)
        except TimeoutError:
            if abort.is_set():
                raise WorkerError(f"gave up waiting for {what}: another pipeline thread failed") from None


def done_future(value: Any = None) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut
