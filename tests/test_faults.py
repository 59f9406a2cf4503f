"""Fault injection: each of the run's threads failing mid-run ends it promptly, names the thread
and the step, and leaves the newest complete checkpoint intact and resumable."""
from __future__ import annotations

import time

import pytest

from slidetune.faults import ENV
from test_train_errors import COMMON, assert_loads, metric_steps, run_cli


@pytest.fixture(scope="module", autouse=True)
def warm_tokenizer():
    """The embedded tokenizer, loaded once (20-60 s on 2 busy cores) before any run is timed."""
    from slidetune.models.load import embedded_tokenizer
    embedded_tokenizer()


@pytest.mark.slow
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


def test_non_finite_gradient_ends_the_run_naming_the_step_and_checkpoint_2_resumes(tmp_path, monkeypatch):
    """nan:4 makes step 4's loss, hence its gradients and their norm, NaN in the engine itself: the run
    stops (it does not skip the step: a NaN means the settings or the data need a look) naming step 4,
    saves nothing of it, and the same command without the fault continues from checkpoint 2."""
    d = tmp_path / "nan"
    args = [*COMMON, "--max-steps", "5", "--save-every", "2", "--output-dir", str(d)]
    monkeypatch.setenv(ENV, "nan:4")
    t0 = time.monotonic()
    code, out, err = run_cli(*args)
    assert code == 2, err[-2000:]
    assert time.monotonic() - t0 < 30 + 15
    assert "non-finite loss (nan) at step 4: training stopped" in err, err[-2000:]
    assert "checkpoint-2, is intact" in err and "--resume auto" in err
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["checkpoint-2"]
    assert_loads(d / "checkpoints" / "checkpoint-2")
    assert metric_steps(d) == [0, 1, 2, 3]
    monkeypatch.delenv(ENV)
    code, out, err = run_cli(*args, "--resume", "auto")
    assert code == 0, err[-2000:]
    assert "at step 2 of 5" in out and metric_steps(d)[-1] == 5


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["slide", "gpu"])
def test_out_of_memory_mid_step_names_the_oom_the_step_the_limit_and_the_fix(mode, tmp_path, monkeypatch):
    """oom:3 raises torch.OutOfMemoryError in the compute path of step 3 (past the forward, with the
    slide pipeline's uploads in flight): the run ends at once with a message naming the OOM, the step,
    the memory limit and what to change; checkpoint 2 is intact and the run resumes from it."""
    d = tmp_path / mode
    args = [*COMMON, "--mode", mode, "--max-steps", "4", "--save-every", "2", "--gpu-memory-limit", "24",
            "--output-dir", str(d)]
    monkeypatch.setenv(ENV, "oom:3")
    t0 = time.monotonic()
    code, out, err = run_cli(*args)
    assert code == 2, err[-2000:]
    assert time.monotonic() - t0 < 30 + 15
    assert "GPU out of memory during step 3: training stopped" in err, err[-2000:]
    assert "the GPU memory limit is 24 GiB (--gpu-memory-limit)" in err
    assert "checkpoint-2, is intact" in err and "--resume auto" in err
    assert "--batch-size" in err and "--grad-accum" in err and "--seq-len" in err
    assert ("--offload-activations" in err) == (mode == "slide")
    assert "Traceback" not in err
    assert_loads(d / "checkpoints" / "checkpoint-2")
    monkeypatch.delenv(ENV)
    code, out, err = run_cli(*args, "--resume", "auto")
    assert code == 0, err[-2000:]
    assert "at step 2 of 4" in out and metric_steps(d)[-1] == 4


def test_out_of_memory_in_the_first_step_says_no_step_had_finished(tmp_path, monkeypatch):
    """An OOM before any step of the run finished (a batch that never fits, as the GPU machine's
    real OOM case): the message does not point at metrics the run never wrote."""
    d = tmp_path / "first"
    monkeypatch.setenv(ENV, "oom:1")
    code, out, err = run_cli(*COMMON, "--mode", "gpu", "--max-steps", "2", "--save-every", "0",
                             "--output-dir", str(d))
    assert code == 2, err[-2000:]
    assert "GPU out of memory during step 1: training stopped" in err, err[-2000:]
    assert "no checkpoint had been written yet; no step of this run had finished" in err
    assert "finished steps' metrics" not in err and "Traceback" not in err


def test_the_fault_hook_refuses_an_unknown_kind(monkeypatch):
    from slidetune.faults import maybe_fail
    monkeypatch.setenv(ENV, "gpu:3")
    with pytest.raises(ValueError, match="KIND one of upload, d2h, host, checkpoint, data, oom, nan"):
        maybe_fail("upload", 3)


def test_a_gpu_memory_limit_of_zero_is_refused_naming_the_flag(tmp_path):
    code, out, err = run_cli(*COMMON, "--gpu-memory-limit", "0", "--output-dir", str(tmp_path / "r"))
    assert code == 2 and "gpu_memory_limit must be > 0 GiB" in err, err[-2000:]
    assert not (tmp_path / "r").exists()
