"""One run per directory: an advisory lock held for the whole run on its output directory and on
the directory its checkpoints are written to (`<output_dir>/checkpoints` or a `--checkpoint-dir`:
whatever named it; one inside the output directory that is not there yet when the run starts is
covered by the output directory's lock instead, below), so that two runs never write into one
directory.

The lock is `fcntl.flock` on `<directory>/.slidetune.lock`, which holds the holder's pid, host, start
time and the directory's role. A second run is refused at once, naming them. So is a run whose
output or checkpoint directory lies inside a directory another live run holds (a checkpoint
directory in another run's output directory, e.g.): its files would mix with that run's. The
kernel releases a flock when its process ends, however it ends (kill -9, the OOM killer): a lock
file left by a dead run is simply locked again, with a note naming the pid it was left by. The file
is removed when the run ends, so a finished run leaves nothing behind. Removing it is safe against
a run opening it meanwhile: a lock is taken only when the file locked is still the one at the path
(same inode), else the opening run tries again on the new file.

On Windows (no `fcntl`) the lock is msvcrt's byte-range lock on one byte far past the record (a
Windows lock is mandatory: one on the record would keep other runs from reading who holds it),
exclusive only: a probe takes it and gives it back at once. The kernel releases it too when the
process ends.

Not guaranteed: a filesystem without flock (some network filesystems answer ENOLCK or EOPNOTSUPP;
the run then goes on unlocked, with a note), runs on two hosts sharing a network directory whose
flock is local to each host, and the other order of nesting: a run started inside the directory
of one that starts later is not found by it (a run does not search the directories below its own).
"""
from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl
except ImportError:               # Windows: msvcrt's locks stand in (_lock_nb)
    fcntl = None

LOCK_NAME = ".slidetune.lock"
_ATTEMPTS = 20            # each retry means another run removed the file between our open and our lock
# A run probing whether a directory above its own is held (_live_holder) holds a shared lock on it
# for a few microseconds; a run locking that directory just then retries rather than being refused
# by a holder that is not one.
_BUSY_RETRIES, _BUSY_WAIT_S = 3, 0.01
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES, errno.EDEADLK)    # EDEADLK: msvcrt's "held"
_MSVCRT_LOCK_AT = 1 << 30        # the byte msvcrt locks: past any record, which stays readable


class RunDirLocked(RuntimeError):
    """Another live run holds the directory's lock; the message names it."""


@dataclass
class RunLock:
    """A held lock on one directory (`release()` gives it back and removes the lock file)."""
    directory: Path
    role: str                        # "output directory" | "checkpoint directory": named in messages
    fd: int | None
    created: tuple[Path, ...] = ()   # the directories the lock created, deepest first: removed again if still empty

    @property
    def path(self) -> Path:
        return self.directory / LOCK_NAME

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)        # while still locked: a run waiting on this inode sees it gone
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None
        _remove_if_empty(self.created)  # a run refused early leaves no empty output directory behind


def lock_directory(directory: Path, role: str) -> RunLock:
    """Lock `directory` (created if missing) for this run; `role` names it in messages ("output
    directory", "checkpoint directory"). Raises RunDirLocked when a live run holds it."""
    directory = Path(directory)
    created = _missing(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    for _ in range(_ATTEMPTS):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _flock_exclusive(fd)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno in _BUSY:
                _remove_if_empty(created)
                raise RunDirLocked(f"the {role} {directory} is in use by another run ({_describe(holder)}; lock file "
                                   f"{path}): two runs in one directory would overwrite each other's checkpoints "
                                   f"and metrics. Wait for it to end, or use another --output-dir"
                                   + (" / --checkpoint-dir" if role != "output directory" else "")) from None
            # ENOLCK / EOPNOTSUPP: a filesystem without flock (some network filesystems)
            print(f"note: cannot lock the {role} {directory} ({e.strerror}): this filesystem has no flock, so "
                  f"nothing stops a second run from writing into it at the same time", file=sys.stderr)
            return RunLock(directory, role, None)
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if not same:                 # the holder removed this file as it ended: lock the new one
            os.close(fd)
            continue
        previous = _read_holder(fd)
        if previous:
            print(f"note: took over the lock {path} left by a run that no longer holds it ({_describe(previous)}: "
                  f"it ended without removing the file, e.g. killed)", file=sys.stderr)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                  "command": " ".join(sys.argv), "role": role}
        os.ftruncate(fd, 0)
        _pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        return RunLock(directory, role, fd, created)
    raise RunDirLocked(f"could not lock the {role} {directory}: {path} was replaced {_ATTEMPTS} times while "
                       f"locking it (other runs starting and ending there)")


def lock_run_directories(output_dir: Path, checkpoint_dir: Path | None) -> list[RunLock]:
    """The output directory's lock and the checkpoint directory's: `checkpoint_dir` is where the
    run writes its checkpoints, its default `<output_dir>/checkpoints` included (None: the output
    directory itself). One inside the output directory that does not exist yet is not created for a
    lock (a run that saves none leaves none behind): the output directory's lock covers it, as any
    other run given it is refused as inside a live run's directory (refuse_nested, asked of both).
    All or none: a refusal releases those taken, the deepest first (a directory a lock created is
    removed again)."""
    held = [lock_directory(output_dir, "output directory")]
    try:
        if checkpoint_dir is not None and _needs_own_lock(Path(checkpoint_dir), Path(output_dir)):
            held.append(lock_directory(checkpoint_dir, "checkpoint directory"))
        refuse_nested(held)
    except BaseException:
        for lock in reversed(held):
            lock.release()
        raise
    return held


def _needs_own_lock(checkpoint_dir: Path, output_dir: Path) -> bool:
    """Whether the checkpoint directory takes a lock of its own (see lock_run_directories)."""
    ckpt, out = checkpoint_dir.resolve(), output_dir.resolve()
    if ckpt == out:
        return False
    return checkpoint_dir.exists() or out not in ckpt.parents


def refuse_nested(held: list[RunLock]) -> None:
    """RunDirLocked when a directory of `held` lies inside one that another live run holds: a
    checkpoint directory inside another run's output directory would have its files mixed with that
    run's, among that run's checkpoint rotation and final export. Asked once this run's own locks are
    taken, so that a directory another run holds itself is refused as in use, the plainer message."""
    ours = {lock.directory.resolve() for lock in held}
    for lock in held:
        for above in lock.directory.resolve().parents:
            if above in ours:
                continue
            holder = _live_holder(above)
            if holder is not None:
                theirs = holder.get("role") or "directory"
                raise RunDirLocked(f"the {lock.role} {lock.directory} is inside {above}, the {theirs} of another run "
                                   f"({_describe(holder)}; lock file {above / LOCK_NAME}): its files would mix with "
                                   f"that run's, which could replace them. Wait for it to end, or use a directory "
                                   f"outside {above}")


def _live_holder(directory: Path) -> dict | None:
    """The lock record of a live run holding `directory` (None: no lock file, or no run holds it, or
    no flock there). Asked with a shared flock tried without waiting and given back at once: it is
    refused only while a run holds the lock."""
    try:
        fd = os.open(directory / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            _lock_nb(fd, shared=True)
        except OSError as e:
            return _read_holder(fd) if e.errno in _BUSY else None
        _unlock(fd)
        return None
    finally:
        os.close(fd)


def _flock_exclusive(fd: int) -> None:
    """flock(LOCK_EX) without waiting, tried again a few times over ~30 ms while held (_BUSY_RETRIES)."""
    for attempt in range(_BUSY_RETRIES + 1):
        try:
            _lock_nb(fd)
            return
        except OSError as e:
            if e.errno not in _BUSY or attempt == _BUSY_RETRIES:
                raise
            time.sleep(_BUSY_WAIT_S)


def _lock_nb(fd: int, shared: bool = False) -> None:
    """Take the file's lock without waiting: OSError with an errno in _BUSY where another run holds
    it. flock; without fcntl (Windows), msvcrt's lock on the byte _MSVCRT_LOCK_AT, exclusive only."""
    if fcntl is not None:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        return
    import msvcrt
    os.lseek(fd, _MSVCRT_LOCK_AT, os.SEEK_SET)
    msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)


def _unlock(fd: int) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return
    import msvcrt
    os.lseek(fd, _MSVCRT_LOCK_AT, os.SEEK_SET)
    msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)


def _pread(fd: int, n: int, offset: int) -> bytes:
    """os.pread, or a seek and a read where the platform has none (Windows)."""
    if hasattr(os, "pread"):
        return os.pread(fd, n, offset)
    os.lseek(fd, offset, os.SEEK_SET)
    return os.read(fd, n)


def _pwrite(fd: int, data: bytes, offset: int) -> None:
    if hasattr(os, "pwrite"):
        os.pwrite(fd, data, offset)
        return
    os.lseek(fd, offset, os.SEEK_SET)
    os.write(fd, data)


def _read_holder(fd: int) -> dict:
    try:
        data = json.loads(_pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _describe(holder: dict) -> str:
    if not holder.get("pid"):
        return "pid not yet written: it is just starting"
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder['pid']} on host {holder.get('host', '?')}, started {when}"


def _missing(directory: Path) -> tuple[Path, ...]:
    """`directory` and those of its parents that do not exist yet, deepest first."""
    missing = []
    for p in (directory, *directory.parents):
        if p.exists():
            break
        missing.append(p)
    return tuple(missing)


def _remove_if_empty(directories: tuple[Path, ...]) -> None:
    """Remove the directories (deepest first) while they are empty: those a lock created."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return
