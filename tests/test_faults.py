"""Fault injection: each of the run's threads failing mid-run ends it promptly, names the thread
and the step, and leaves the newest complete checkpoint intact and resumable."""
from __future__ import annotations

import time

import pytest

from slidetune.faults import ENV
from test_train_errors import COMMON, assert_loads, metric_steps, run_cli


@pytest.mark.parametrize("thread", ["upload", "d2h", "host", "checkpoint", "data"])
def test_a_thread_failing_at_step_4_leaves_checkpoint_2_resumable(thread, tmp_path, monkeypatch):
    """The pipeline threads fail in their first job of step 4 (the next step's uploads start while
    step 3 is saved or ends, so step 4, not 3: a save that synchronizes runs them), the checkpoint
    writer in the save of step 4, the data loader building step 4."""
    d = tmp_path / thread
    args = [*COMMON, "--max-steps", "5", "--save-every", "2", "--tuning.cache_units", "2", "--output-dir", str(d)]
    monkeypatch.setenv(ENV, f"{thread}:4")
    t0 = time.monotonic()
    code, out, err = run_cli(*args)
    assert code == 2, err[-2000:]
    assert time.monotonic() - t0 < 30 + 15          # the run itself takes a few seconds here
    assert f"injected fault in the {thread} thread at step 4" in err, err[-2000:]
    ckpt = d / "checkpoints" / "checkpoint-2"
    assert_loads(ckpt)
    assert not any(".tmp-" in p.name for p in (d / "checkpoints").iterdir())
    # the same command, without the fault, continues from checkpoint 2 and finishes
    monkeypatch.delenv(ENV)
    code, out, err = run_cli(*args, "--resume", "auto")
    assert code == 0, err[-2000:]
    assert "at step 2 of 5" in out
    assert metric_steps(d)[-1] == 5
    assert_loads(d / "final")
