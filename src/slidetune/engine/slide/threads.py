"""The slide engine's worker threads and what they share: one failure ends them all.

One failing thread must not leave the others blocked forever: every host-side wait polls the
abort flag, set by whichever thread fails first, and the compute thread re-raises that first
error (the root cause; later failures are its consequences). The compute thread's own waits
are bounded by the watchdog (watchdog.py). The threads (engine.py's docstring says who does
what): upload, d2h issuer, host worker, and under data parallel the follower and, with
dp_weights=gather, the gather thread.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import Future
from typing import Callable

import torch
from torch.profiler import record_function

from ...faults import ENV as FAULT_ENV
from ...faults import maybe_fail
from ...telemetry.host_timeline import HostTimeline
from .watchdog import Watchdog
from .workers import DeadlineWorker, Worker, WorkerError

WAIT_S = 1.0   # poll period while waiting on a worker future (to surface worker errors)


class PipelineThreads:
    """The worker threads, the abort flag and first error they share, and the compute thread's
    waits on them. `step_index()`: the step being issued (for the reports and fault injection)."""

    def __init__(self, timeline: HostTimeline, step_index: Callable[[], int]):
        self.timeline = timeline
        self.step_index = step_index
        self.abort = threading.Event()
        self.first_error: BaseException | None = None
        self.failed_where = "a pipeline thread failed"
        self.watchdog = Watchdog()                    # bounds every wait of the compute thread (watchdog.py)
        self.upload_worker: Worker | None = None
        self.host_worker: DeadlineWorker | None = None
        self.d2h_worker: DeadlineWorker | None = None
        self.follower: Worker | None = None
        self.gather_worker: Worker | None = None
        self._switch_interval: float | None = None     # the interpreter's, while the threads run

    def start(self, follower: bool, gather: bool, host_threads: int, gil_switch_s: float) -> None:
        """Start the threads: upload, host (earliest deadline first under update_order=deadline:
        workers.DeadlineWorker), d2h (the same, so the ring carries the most urgent gradients);
        `follower`: data parallel's waits for the other owners' updates, so the host worker itself
        never waits on another rank; `gather`: dp_weights=gather's broadcasts. `host_threads`:
        the host worker's OpenMP threads (the count is per calling thread: set on the worker);
        `gil_switch_s`: the interpreter's switch interval while they run (close() restores it):
        the workers need the GIL between their (GIL-free) kernels while the compute thread runs
        Python, and the default 5 ms would stall each hand-off."""
        self.upload_worker = Worker("upload", self.on_error)
        self.host_worker = DeadlineWorker("host", self.on_error)
        self.d2h_worker = DeadlineWorker("d2h", self.on_error)
        self.follower = Worker("follow", self.on_error) if follower else None
        self.gather_worker = Worker("gather", self.on_error) if gather else None
        for worker in (self.upload_worker, self.host_worker, self.d2h_worker):
            # tests only (faults.py): the step a job runs in is the one being issued
            worker.before_job = (lambda name=worker.name: maybe_fail(name, self.step_index() + 1)) \
                if os.environ.get(FAULT_ENV) else None
        self.host_worker.submit(torch.set_num_threads, host_threads).result()
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(gil_switch_s)

    def workers(self) -> list:
        return [w for w in (self.upload_worker, self.d2h_worker, self.host_worker, self.follower,
                            self.gather_worker) if w is not None]

    def timed(self, thread: str, what: str, unit: str, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` as a span of the host timeline (workers._describe reads these
        arguments for the watchdog's report)."""
        with self.timeline.span(thread, what, unit):
            return fn(*args, **kwargs)

    # ------------------------------------------------------------- failures
    def on_error(self, error: BaseException, thread: str = "a pipeline") -> None:
        if self.first_error is None:          # the root cause; later failures are consequences
            self.first_error = error
            self.failed_where = f"the {thread} thread failed during step {self.step_index() + 1}"
        self.abort.set()

    def raise_if_aborted(self) -> None:
        if self.abort.is_set():
            err = self.first_error
            raise WorkerError(f"{self.failed_where}: {err!r}") from err

    def wait(self, fut: Future, what: str = "wait", unit: str = ""):
        """The compute thread's wait on a worker's future: polls the abort flag, bounded by the
        watchdog, and reports the root cause where the job failed because another thread did."""
        try:
            if fut.done():
                return fut.result()
            with self.timeline.span("compute", what, unit), record_function(f"slidetune.{what}"):
                return self._wait_loop(fut, f"{what} {unit}".strip())
        except Exception as e:
            first = self.first_error
            if first is not None and e is not first:
                # a consequence of an earlier failure: report the root cause
                raise WorkerError(f"{self.failed_where}: {first!r}") from first
            raise

    def _wait_loop(self, fut: Future, what: str = "a pipeline thread"):
        t0 = time.monotonic()
        while True:
            try:
                return fut.result(timeout=WAIT_S)
            except TimeoutError:
                self.raise_if_aborted()
                self.watchdog.check(time.monotonic() - t0, what, self.workers())

    def rooted(self, fut: Future) -> Future:
        """`fut`, but failing with the root cause where its job failed because another thread did
        (it gave up waiting): the caller learns which thread failed first, and in which step."""
        out: Future = Future()

        def done(f: Future) -> None:
            err = f.exception()
            if err is None:
                out.set_result(f.result())
            elif self.first_error is not None and err is not self.first_error:
                out.set_exception(WorkerError(f"{self.failed_where}: {self.first_error!r}"))
            else:
                out.set_exception(WorkerError(f"{self.failed_where}: {err!r}") if self.first_error is err else err)
        fut.add_done_callback(done)
        return out

    # ------------------------------------------------------------- draining
    def drain(self) -> None:
        """Wait until every job queued so far has run, in the order work hands on: copies ->
        updates -> (an update's start releases the uploads registered on it,
        HostUnit.begin_update: an owner's on the host worker, another rank's unit on the
        follower) -> uploads -> broadcasts. The follower drained after the uploader could still
        submit an upload once drain() had returned (test_data_parallel's upload count read one
        unit short on a loaded CI machine)."""
        for worker in (self.d2h_worker, self.host_worker, self.follower, self.upload_worker, self.gather_worker):
            if worker is not None:
                worker.drain()

    def close(self) -> None:
        for worker in (self.upload_worker, self.host_worker, self.d2h_worker, self.follower, self.gather_worker):
            if worker is not None:
                worker.close()
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None
