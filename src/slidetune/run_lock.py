"""One run per directory: an advisory lock held for the whole run on its output directory (and on a
`--checkpoint-dir` of its own), so that two runs never write into one directory.

The lock is `fcntl.flock` on `<directory>/.slidetune.lock`, which holds the holder's pid, host and
start time. A second run is refused at once, naming them. The kernel releases a flock when its
process ends, however it ends (kill -9, the OOM killer): a lock file left by a dead run is simply
locked again, with a note naming the pid it was left by. The file is removed when the run ends, so
a finished run leaves nothing behind. Removing it is safe against a run opening it meanwhile: a
lock is taken only when the file locked is still the one at the path (same inode), else the
opening run tries again on the new file.

Not guaranteed: a filesystem without flock (some network filesystems answer ENOLCK or EOPNOTSUPP;
the run then goes on unlocked, with a note), and runs on two hosts sharing a network directory
whose flock is local to each host.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

LOCK_NAME = ".slidetune.lock"
_ATTEMPTS = 20            # each retry means another run removed the file between our open and our lock


class RunDirLocked(RuntimeError):
    """Another live run holds the directory's lock; the message names it."""


@dataclass
class RunLock:
    """A held lock on one directory (`release()` gives it back and removes the lock file)."""
    directory: Path
    fd: int | None
    created_directory: bool        # the lock created the directory: removed again if still empty

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
        if self.created_directory:
            try:
                self.directory.rmdir()   # a run refused early leaves no empty output directory behind
            except OSError:
                pass


def lock_directory(directory: Path, role: str) -> RunLock:
    """Lock `directory` (created if missing) for this run; `role` names it in messages ("output
    directory", "checkpoint directory"). Raises RunDirLocked when a live run holds it."""
    directory = Path(directory)
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    for _ in range(_ATTEMPTS):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                if created:
                    _remove_if_empty(directory)
                raise RunDirLocked(f"the {role} {directory} is in use by another run ({_describe(holder)}; lock file "
                                   f"{path}): two runs in one directory would overwrite each other's checkpoints "
                                   f"and metrics. Wait for it to end, or use another --output-dir"
                                   + (" / --checkpoint-dir" if role != "output directory" else "")) from None
            # ENOLCK / EOPNOTSUPP: a filesystem without flock (some network filesystems)
            print(f"note: cannot lock the {role} {directory} ({e.strerror}): this filesystem has no flock, so "
                  f"nothing stops a second run from writing into it at the same time", file=sys.stderr)
            return RunLock(directory, None, False)
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
                  "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        return RunLock(directory, fd, created)
    raise RunDirLocked(f"could not lock the {role} {directory}: {path} was replaced {_ATTEMPTS} times while "
                       f"locking it (other runs starting and ending there)")


def lock_run_directories(output_dir: Path, checkpoint_dir: Path | None) -> list[RunLock]:
    """The output directory's lock, and a separate checkpoint directory's (one shared by two
    output directories is refused just the same). All or none: a refusal releases those taken."""
    held = [lock_directory(output_dir, "output directory")]
    if checkpoint_dir is not None and Path(checkpoint_dir).resolve() != Path(output_dir).resolve():
        try:
            held.append(lock_directory(checkpoint_dir, "checkpoint directory"))
        except BaseException:
            held[0].release()
            raise
    return held


def _read_holder(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _describe(holder: dict) -> str:
    if not holder.get("pid"):
        return "pid not yet written: it is just starting"
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder['pid']} on host {holder.get('host', '?')}, started {when}"


def _remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:
        pass
