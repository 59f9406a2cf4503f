"""A FIFO worker thread for the host side of the pipeline.

Jobs run in submission order on one thread. Torch releases the GIL inside its
kernels, so casts, copies and AdamW run in parallel with the compute thread. A job
that raises poisons the worker: every later job fails with the same error and
`check()` re-raises it in the caller, so a failure never turns into a hang.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


class WorkerError(RuntimeError):
    pass


class Worker:
    def __init__(self, name: str, on_error: Callable[[BaseException], None] | None = None):
        self.name = name
        self._on_error = on_error
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"slidetune-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args, **kwargs) -> Future:
        fut: Future = Future()
        self._jobs.put((fut, fn, args, kwargs))
        return fut

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fut, fn, args, kwargs = item
            if self._error is not None:
                fut.set_exception(WorkerError(f"{self.name} worker failed earlier: {self._error!r}"))
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - forwarded to the compute thread
                self._error = e
                fut.set_exception(e)
                if self._on_error is not None:
                    self._on_error(e)

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
