"""No silent hangs: a stalled pipeline thread ends the step with a message, not a wait forever."""
from __future__ import annotations

import threading
import time

import pytest

from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
from slidetune.engine.slide.watchdog import FIRST_S, MIN_S, STEP_FACTOR, HangError, Watchdog
from test_equivalence import make_batches, make_loaded


def test_the_bound_follows_the_measured_steps():
    w = Watchdog()
    assert w.bound_s() == FIRST_S                       # before two steps are timed
    for s in (0.5, 0.6, 0.4):
        w.record_step(s)
    assert w.bound_s() == MIN_S                         # 20 x 0.5 s is below the floor
    for s in (10.0, 10.0, 10.0, 10.0):
        w.record_step(s)
    assert w.bound_s() == STEP_FACTOR * 10.0
    w.check(STEP_FACTOR * 10.0, "x", [])                # at the bound: fine
    with pytest.raises(HangError, match="waited 201 s for an upload"):
        w.check(201.0, "an upload", [])


def test_a_stalled_upload_thread_ends_the_step_with_the_stacks(capsys):
    """The upload thread stops making progress (an injected stall): within the bound (here 1 s)
    the compute thread prints every thread's stack and what each worker runs, and raises."""
    loaded = make_loaded("llama", tied=False, layers=4)      # 2 window slots for 4 layers: uploads every step
    engine = build_engine(loaded, RuntimeConfig(mode="slide", dtype="fp32", device="cpu", cache_units=2),
                          AdamWConfig(lr=1e-3))
    release = threading.Event()
    real = engine.uploader.upload

    def stalled(*a, **k):
        release.wait(60)
        return real(*a, **k)

    try:
        engine.train_step(make_batches(0, 1), 1e-3)        # a normal step first
        engine.threads.watchdog.override_s = 1.0
        engine.uploader.upload = stalled
        t0 = time.monotonic()
        with pytest.raises(HangError) as e:
            engine.train_step(make_batches(1, 1), 1e-3)
        assert time.monotonic() - t0 < 10
        msg = str(e.value)
        assert "upload: running upload" in msg and "--resume auto" in msg
        err = capsys.readouterr().err
        assert "slidetune watchdog" in err and "Thread" in err and "stalled" in err
    finally:
        release.set()
        engine.uploader.upload = real
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - the interrupted step's leftovers
            pass
