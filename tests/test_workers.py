"""The host-side worker threads of the slide pipeline (engine/slide/workers.py)."""
from __future__ import annotations

import threading

from slidetune.engine.slide.workers import DeadlineWorker


def _blocked(worker: DeadlineWorker) -> threading.Event:
    gate = threading.Event()
    worker.submit(gate.wait)          # a barrier: everything after it waits
    return gate


def test_earliest_deadline_first_among_ready_jobs():
    w = DeadlineWorker("t")
    try:
        ran: list[str] = []
        gate = _blocked(w)
        for name, deadline in [("head", 9), ("l3", 4), ("l2", 3), ("l1", 2), ("embed", 0)]:
            w.submit(ran.append, name, deadline=deadline)
        gate.set()
        w.drain()
        assert ran == ["embed", "l1", "l2", "l3", "head"]
    finally:
        w.close()


def test_barriers_split_the_schedule():
    """Jobs after a barrier never overtake it; the barrier runs after all jobs before it."""
    w = DeadlineWorker("t")
    try:
        ran: list[str] = []
        gate = _blocked(w)
        w.submit(ran.append, "a9", deadline=9)
        w.submit(ran.append, "a1", deadline=1)
        w.submit(ran.append, "barrier")
        w.submit(ran.append, "b0", deadline=0)
        gate.set()
        w.drain()
        assert ran == ["a1", "a9", "barrier", "b0"]
    finally:
        w.close()


def test_a_job_waits_until_it_is_ready():
    """A ready job with a later deadline beats one not ready yet; that one runs once ready."""
    w = DeadlineWorker("t")
    try:
        ran: list[str] = []
        flag = threading.Event()
        gate = _blocked(w)
        w.submit(ran.append, "early-blocked", deadline=0, ready=flag.is_set)
        w.submit(ran.append, "late-ready", deadline=5, ready=lambda: True)
        gate.set()
        done = w.submit(lambda: None)          # a barrier: waits for both
        assert not done.done() or ran == ["late-ready", "early-blocked"]
        threading.Timer(0.05, lambda: (flag.set(), w.notify())).start()
        done.result(timeout=5)
        assert ran == ["late-ready", "early-blocked"]
    finally:
        w.close()


def test_a_failing_job_poisons_later_jobs():
    w = DeadlineWorker("t")
    errors = []
    try:
        def boom():
            raise RuntimeError("x")
        f1 = w.submit(boom, deadline=0)
        f2 = w.submit(lambda: 1, deadline=1)
        assert isinstance(f1.exception(timeout=5), RuntimeError)
        errors.append(f2.exception(timeout=5))
        assert errors[0] is not None
    finally:
        w.close()


def test_whole_jobs_go_before_partial_ones_but_partial_ones_still_run():
    """Among ready jobs, the whole ones (every gradient chunk landed) run first, earliest
    deadline first; a ready job that is not whole runs once no whole one is left, so
    `whole` never holds the worker up (the last unit in the ring may be partial)."""
    w = DeadlineWorker("t")
    try:
        ran: list[str] = []
        gate = _blocked(w)
        w.submit(ran.append, "newest-partial", deadline=1, ready=lambda: True, whole=lambda: False)
        w.submit(ran.append, "older-whole", deadline=7, ready=lambda: True, whole=lambda: True)
        w.submit(ran.append, "oldest-whole", deadline=9, ready=lambda: True)      # no whole(): whole
        gate.set()
        w.drain()
        assert ran == ["older-whole", "oldest-whole", "newest-partial"]
    finally:
        w.close()
