"""One run per directory (checkpoint/lock.py): a second run on an output directory, or on a checkpoint
directory shared by two output directories, is refused at once naming the holder; the first run
is untouched; a lock file left by a killed run is taken over with a note."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import slidetune
import slidetune.trainer  # noqa: F401 - imported before the clock starts: the refusal is timed, not the imports
from slidetune.checkpoint.lock import LOCK_NAME
from test_train_errors import COMMON, assert_loads, metric_steps, run_cli, small_corpus  # noqa: F401

SRC = str(Path(slidetune.__file__).resolve().parents[1])
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}


def wait_for_lock(directory: Path, proc: subprocess.Popen, timeout_s: float = 120.0) -> dict:
    """The lock record the running `proc` wrote in `directory`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        try:
            record = json.loads((directory / LOCK_NAME).read_text())
            if record.get("pid") == proc.pid:
                return record
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    raise AssertionError("the first run never took its lock")


@pytest.mark.slow

def assert_kept_its_own_files(out: Path, ckpts: Path) -> None:
    """The first run's files are its own (its lr 1e-5, steps 1-6, checkpoints 4 and 6): its config,
    every step's metrics, its checkpoints and final/, and no lock left behind."""
    assert json.loads((out / "config.json").read_text())["optim"]["lr"] == 1e-5
    assert metric_steps(out) == [0, *range(1, 7), 6]
    assert sorted(p.name for p in ckpts.iterdir()) == ["checkpoint-4", "checkpoint-6"]
    assert_loads(out / "final")
    assert not (out / LOCK_NAME).exists() and not (ckpts / LOCK_NAME).exists()

def test_a_second_run_on_a_directory_in_use_is_refused_and_the_first_finishes_intact(tmp_path):
    first, shared_ckpts = tmp_path / "first", tmp_path / "ckpts"
    # it loads its model after taking the lock: seconds in which the others are refused
    proc = subprocess.Popen([sys.executable, "-m", "slidetune.cli", "train", *COMMON, "--max-steps", "6",
                             "--save-every", "2", "--lr", "1e-5", "--output-dir", str(first),
                             "--checkpoint-dir", str(shared_ckpts)],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_lock(first, proc)
        wait_for_lock(shared_ckpts, proc)
        t0 = time.monotonic()
        code, out, err = run_cli(*COMMON, "--max-steps", "2", "--lr", "3e-3", "--output-dir", str(first))
        refused_s = time.monotonic() - t0
        assert code == 2 and "Traceback" not in err, err[-2000:]
        assert f"the output directory {first} is in use by another run (pid {proc.pid}" in err, err
        assert "started 20" in err                    # its start time, as a date
        assert refused_s < 2.0, f"refused after {refused_s:.1f} s: not at once"
        # another output directory, the same --checkpoint-dir: refused just the same
        other = tmp_path / "other"
        code, out, err = run_cli(*COMMON, "--max-steps", "2", "--output-dir", str(other),
                                 "--checkpoint-dir", str(shared_ckpts))
        assert code == 2 and f"the checkpoint directory {shared_ckpts} is in use" in err, err[-2000:]
        assert f"pid {proc.pid}" in err
        assert not other.exists(), "a refused run left its output directory behind"
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert_kept_its_own_files(first, shared_ckpts)


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_note(tmp_path):
    d = tmp_path / "run"
    # a process that takes the lock and dies without releasing it (as kill -9 leaves it)
    holder = subprocess.run([sys.executable, "-c", "import os, sys\n"
                             "from slidetune.checkpoint.lock import lock_directory\n"
                             "lock_directory(sys.argv[1], 'output directory')\nos._exit(0)", str(d)],
                            env=ENV, capture_output=True, text=True)
    assert holder.returncode == 0, holder.stderr
    dead = json.loads((d / LOCK_NAME).read_text())["pid"]
    code, out, err = run_cli(*COMMON, "--max-steps", "1", "--output-dir", str(d))
    assert code == 0, err[-2000:]
    assert f"took over the lock {d / LOCK_NAME} left by a run that no longer holds it (pid {dead}" in err, err
    assert_loads(d / "final")
    assert not (d / LOCK_NAME).exists()


@pytest.mark.slow
def test_another_runs_default_checkpoint_directory_and_one_inside_its_output_are_refused(tmp_path):
    """Issue 51: run A on `a` writes its checkpoints to `a/checkpoints` by default (here already
    there, as an earlier run leaves it: locked as such); a run given that directory by
    --checkpoint-dir, or any directory inside `a`, is refused naming A, and A's checkpoints stay
    its own."""
    a = tmp_path / "a"
    (a / "checkpoints").mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-m", "slidetune.cli", "train", *COMMON, "--max-steps", "6",
                             "--save-every", "2", "--lr", "1e-5", "--output-dir", str(a)],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_lock(a, proc)
        wait_for_lock(a / "checkpoints", proc, timeout_s=30.0)
        b = tmp_path / "b"
        code, out, err = run_cli(*COMMON, "--max-steps", "2", "--lr", "3e-3", "--output-dir", str(b),
                                 "--checkpoint-dir", str(a / "checkpoints"))
        assert code == 2 and "Traceback" not in err, err[-2000:]
        assert f"the checkpoint directory {a / 'checkpoints'} is in use by another run (pid {proc.pid}" in err, err
        assert not b.exists(), "a refused run left its output directory behind"
        # another directory inside A's output directory, as a --checkpoint-dir or an output directory
        for args, role, nested in ((["--output-dir", str(b), "--checkpoint-dir", str(a / "sub" / "ckpts")],
                                    "checkpoint directory", a / "sub" / "ckpts"),
                                   (["--output-dir", str(a / "inner")], "output directory", a / "inner")):
            code, out, err = run_cli(*COMMON, "--max-steps", "2", *args)
            assert code == 2 and "Traceback" not in err, err[-2000:]
            assert f"the {role} {nested} is inside {a}, the output directory of another run (pid {proc.pid}" \
                in err, err
            assert not b.exists(), "a refused run left its output directory behind"
            assert not (a / "sub").exists() and not (a / "inner").exists()
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert_kept_its_own_files(a, a / "checkpoints")


def test_a_checkpoint_directory_inside_a_live_runs_directories_is_refused_naming_it(tmp_path):
    """Live runs (processes holding the locks a run takes): one on output `a` with --checkpoint-dir
    `c`, one on output `r` whose default checkpoint directory `r/checkpoints` exists (a resumed run:
    locked as such). A checkpoint directory inside `a` or `c`, or `r/checkpoints` itself, is refused
    at once, naming the pid that holds it."""
    a, c, b, r = tmp_path / "a", tmp_path / "c", tmp_path / "b", tmp_path / "r"
    (r / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    holders = [subprocess.Popen([sys.executable, "-c", "import sys\nfrom pathlib import Path\n"
                                 "from slidetune.checkpoint.lock import lock_run_directories\n"
                                 "lock_run_directories(Path(sys.argv[1]), Path(sys.argv[2]))\n"
                                 "print('locked', flush=True)\nsys.stdin.read()", str(out), str(ckpts)],
                                env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for out, ckpts in ((a, c), (r, r / "checkpoints"))]
    holder, resumed = holders
    try:
        for h in holders:
            assert h.stdout.readline().strip() == "locked", h.stderr.read()
        code, out, err = run_cli(*COMMON, "--max-steps", "1", "--output-dir", str(b),
                                 "--checkpoint-dir", str(r / "checkpoints"))
        assert code == 2 and "Traceback" not in err, err[-2000:]
        assert f"the checkpoint directory {r / 'checkpoints'} is in use by another run (pid {resumed.pid}" in err, err
        assert not b.exists() and (r / "checkpoints" / "checkpoint-2").is_dir()
        for inside, owner, role in ((a / "x" / "ckpts", a, "output directory"),
                                    (c / "deeper", c, "checkpoint directory")):
            t0 = time.monotonic()
            code, out, err = run_cli(*COMMON, "--max-steps", "1", "--output-dir", str(b),
                                     "--checkpoint-dir", str(inside))
            assert code == 2 and "Traceback" not in err, err[-2000:]
            assert f"the checkpoint directory {inside} is inside {owner}, the {role} of another run " \
                   f"(pid {holder.pid}" in err, err
            assert time.monotonic() - t0 < 2.0
            assert not b.exists() and not inside.exists() and not (a / "x").exists()
    finally:
        for h in holders:
            h.stdin.close()
            h.wait(timeout=60)
    # the holder has ended: the same directories are free again
    code, out, err = run_cli(*COMMON, "--max-steps", "1", "--output-dir", str(b),
                             "--checkpoint-dir", str(a / "x" / "ckpts"))
    assert code == 0, err[-2000:]


# The lock without fcntl (Windows): msvcrt's byte-range lock, here msvcrt's own calls carried out by
# POSIX record locks (fcntl.lockf on the same byte: they too conflict between processes and go
# with the process), with fcntl hidden from checkpoint/lock.py, so its Windows path runs on this machine.
WINDOWS_LIKE = """
import errno, fcntl as _posix, os, subprocess, sys, types
sys.modules["fcntl"] = None
import slidetune.cli, slidetune.trainer      # the package imports without fcntl
msvcrt = types.ModuleType("msvcrt")          # (made after the imports: subprocess takes msvcrt for Windows)
msvcrt.LK_NBLCK, msvcrt.LK_UNLCK = 2, 0
def locking(fd, mode, n):
    # a read-only handle (the probe's) takes POSIX's read lock: it too conflicts with a holder's
    kind = _posix.LOCK_EX if _writable(fd) else _posix.LOCK_SH
    try:
        _posix.lockf(fd, kind | _posix.LOCK_NB if mode == msvcrt.LK_NBLCK else _posix.LOCK_UN, n, 0, os.SEEK_CUR)
    except BlockingIOError as e:
        raise OSError(errno.EDEADLK, "Resource deadlock avoided") from e    # msvcrt's EDEADLOCK where held
def _writable(fd):
    return _posix.fcntl(fd, _posix.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
msvcrt.locking = locking
sys.modules["msvcrt"] = msvcrt
from slidetune.checkpoint import lock as lock_mod
assert lock_mod.fcntl is None
"""


def _windows_like(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WINDOWS_LIKE + code, *args], env=ENV, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_without_fcntl_the_package_imports_and_the_lock_still_refuses_a_second_run(tmp_path):
    """Without fcntl (Windows) `import slidetune` works, and the lock is msvcrt's: a second run on
    the directory, or inside it, is refused naming the holder; once the holder ends it is free."""
    holder = _windows_like("lock = lock_mod.lock_directory(sys.argv[1], 'output directory'); print('held', "
                           "flush=True); sys.stdin.read(); lock.release()", str(tmp_path / "run"))
    assert holder.stdout.readline().strip() == "held", holder.communicate()[1][-2000:]
    try:
        second = _windows_like("""
try:
    lock_mod.lock_run_directories(sys.argv[1], None)
except lock_mod.RunDirLocked as e:
    print("refused:", e)
try:
    lock_mod.lock_run_directories(sys.argv[2], sys.argv[1] + '/inside')
except lock_mod.RunDirLocked as e:
    print("refused:", e)
""", str(tmp_path / "run"), str(tmp_path / "other"))
        out, err = second.communicate(timeout=300)
        assert second.returncode == 0, err[-3000:]
        refusals = [line for line in out.splitlines() if line.startswith("refused:")]
        assert len(refusals) == 2 and all(f"pid {holder.pid}" in r for r in refusals), out
        assert "is in use by another run" in refusals[0] and "is inside" in refusals[1]
    finally:
        holder.communicate("", timeout=60)
    after = _windows_like("lock_mod.lock_directory(sys.argv[1], 'output directory').release(); print('free')",
                          str(tmp_path / "run"))
    out, err = after.communicate(timeout=120)
    assert out.strip() == "free", err[-2000:]
