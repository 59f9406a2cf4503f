"""The directory store: a checkpoint renamed into place whole or not at all, and the run
directory's checkpoints found, pruned and tidied.

save_atomically runs a writer into a fresh `<name>.tmp-<pid>` and renames it into place (an existing
checkpoint of the same name moved aside to `<name>.old-<pid>` first); the fsync helpers the writer
syncs its files and directories with; set_aside for a checkpoint that does not read back as
written; and the run directory's helpers: complete_checkpoints, latest_checkpoint,
prune_checkpoints, recover_leftovers (what a killed save left). The guarantees: the package
docstring, "Atomicity"."""
from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from ..processes import pid_alive
from .format import CKPT_RE, COMPLETE, CheckpointCorrupt, CheckpointError

# `<name>.tmp-<pid>` / `<name>.old-<pid>`: the directories save_atomically writes and moves aside
_LEFTOVER_RE = re.compile(r"^(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)$")


def save_atomically(out_dir: Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` fills a fresh sibling `<name>.tmp-<pid>` with a complete, verified checkpoint;
    then it is renamed to `out_dir` (_swap_in). Any failure removes tmp (or sets it aside where it
    did not read back as written) and raises CheckpointError saying which checkpoint is intact."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    aside = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}")
    previous = out_dir if _is_complete(out_dir) else latest_checkpoint(out_dir.parent)
    try:
        write(tmp)
        _swap_in(tmp, out_dir, aside)
    except BaseException as e:
        kept = None
        if isinstance(e, CheckpointCorrupt) and tmp.exists():
            kept = set_aside(tmp, out_dir.name)          # evidence of a bad disk: never deleted
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, Exception):
            raise
        raise CheckpointError(f"saving the checkpoint {out_dir} failed ({type(e).__name__}: {e}); "
                              f"{_what_remains(out_dir, previous, kept)}") from e
    shutil.rmtree(aside, ignore_errors=True)
    return out_dir


def fresh_dir(tmp: Path) -> None:
    """An empty `tmp` (what a dead earlier save left there removed)."""
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()


def _swap_in(tmp: Path, final: Path, aside: Path) -> None:
    """Rename tmp to final; an existing final is moved aside first (deleted by the caller)."""
    moved = False
    if final.exists():
        if aside.exists():
            shutil.rmtree(aside)
        os.replace(final, aside)
        moved = True
    try:
        os.replace(tmp, final)
    except BaseException:
        if moved:
            os.replace(aside, final)     # put the old checkpoint back
        raise
    fsync_dir(final.parent)


def _what_remains(out_dir: Path, previous: Path | None, kept: Path | None) -> str:
    """The failed save's message tail: which checkpoint is intact, and where a damaged one was set aside."""
    if previous is not None:
        where = f"the previous checkpoint {previous} is intact"
    else:
        where = f"no previous checkpoint existed in {out_dir.parent}, and nothing was left behind"
    if kept is not None:
        where = (f"it did not read back as it was written (the disk or filesystem changed it), and is set aside "
                 f"as {kept}; {where.replace(', and nothing was left behind', '')}")
    return where


def set_aside(ckpt_dir: Path, name: str | None = None) -> Path:
    """Rename a damaged checkpoint to `<name>.corrupt-<time>` beside it (kept for inspection, never
    deleted; no run directory helper matches that name) and return the new path."""
    ckpt = Path(ckpt_dir)
    stem = f"{name or ckpt.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}"
    target, n = ckpt.with_name(stem), 1
    while target.exists():
        n += 1
        target = ckpt.with_name(f"{stem}-{n}")
    os.replace(ckpt, target)
    fsync_dir(target.parent)
    return target


# --------------------------------------------------------------------------- fsync
def write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return                           # platforms without directory fds
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory; then drop the files' pages from the page cache (they are
    clean now): the read-back that verifies the save reads the disk, not RAM, and a checkpoint of
    ~100 GB does not evict what the run still uses."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fsync_and_drop(os.path.join(dirpath, name))
        fsync_dir(Path(dirpath))


def fsync_and_drop(path: str | os.PathLike) -> None:
    """fsync a file, then drop its (now clean) pages from the page cache: the next read of it
    reads the disk (the benchmarks' scripts time cold reads with it too)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


# --------------------------------------------------------------------------- run directories
def _is_complete(path: Path) -> bool:
    return path.is_dir() and (path / COMPLETE).exists()


def _complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for p in run_dir.iterdir():
        m = CKPT_RE.match(p.name)
        if m and _is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The complete `checkpoint-<step>` directories of a run, oldest step first (leftovers, set-aside
    and unfinished directories are not among them, as in latest_checkpoint)."""
    return [p for _, p in _complete_checkpoints(run_dir)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The highest-step complete `checkpoint-<step>` directory of a run (None if there is none).

    Temporary (`.tmp-<pid>`), set-aside (`.old-<pid>`) and unfinished (no COMPLETE) directories are ignored.
    """
    found = _complete_checkpoints(run_dir)
    return found[-1][1] if found else None


def prune_checkpoints(run_dir: Path, keep_last: int, verified: Path | None = None) -> None:
    """Delete all but the `keep_last` newest complete checkpoints, and leftovers of dead savers.

    `verified`: the newest checkpoint known good (the one just written and read back, or the one
    a resume checked): never deleted, whatever its rank. Call this only after the newest save
    was verified (save_checkpoint reads each one back before it counts).
    Leftovers are `.tmp-<pid>` / `.old-<pid>` directories of processes that no longer run.
    Other directories (a `final` export, unfinished checkpoints of a live run, checkpoints set
    aside as `.corrupt-<time>`) are left alone.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (got {keep_last}); pruning never deletes the newest checkpoint")
    run_dir = Path(run_dir)
    keep = Path(verified).resolve() if verified is not None else None
    for _, p in _complete_checkpoints(run_dir)[:-keep_last]:
        if p.resolve() != keep:
            shutil.rmtree(p, ignore_errors=True)
    for _, p in _dead_leftovers(run_dir):
        shutil.rmtree(p, ignore_errors=True)


def recover_leftovers(directory: Path, name: str | None = None) -> list[tuple[Path, Path]]:
    """Tidy what killed saves left in `directory` (only those of `<name>`, if given); call at the
    start of a run, before it saves anything there.

    A save killed mid-way (kill -9, the OOM killer) leaves `<name>.tmp-<pid>`, and one killed
    between its two renames also `<name>.old-<pid>` (the package
    docstring, "Atomicity"). Those of processes
    that no longer run are deleted, as prune_checkpoints does; as this process has saved
    nothing yet, one named with its own pid is an earlier process's that had the same pid
    (usual in containers). Except: where `<name>` itself is missing, a complete `.old-`
    directory is the previous save whole, and it is renamed back rather than deleted.
    Returns the (restored from, restored to) pairs.
    """
    directory = Path(directory)
    groups: dict[str, list[tuple[re.Match, Path]]] = {}
    for m, p in _dead_leftovers(directory, ours=True):
        if name is None or m.group("name") == name:
            groups.setdefault(m.group("name"), []).append((m, p))
    restored = []
    for target_name, left in groups.items():
        target = directory / target_name
        back = None
        if not target.exists():
            whole = [p for m, p in left if m.group("kind") == "old" and _is_complete(p)]
            if whole:
                back = max(whole, key=lambda p: (p / COMPLETE).stat().st_mtime)
                os.replace(back, target)
                fsync_dir(directory)
                restored.append((back, target))
        for _, p in left:
            if p != back:
                shutil.rmtree(p, ignore_errors=True)
    return restored


def _dead_leftovers(directory: Path, ours: bool = False) -> list[tuple[re.Match, Path]]:
    """The `.tmp-<pid>` / `.old-<pid>` directories in `directory` of savers that no longer run
    (`ours`: this process's own count as not running)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = _LEFTOVER_RE.match(p.name)
        if m and p.is_dir():
            pid = int(m.group("pid"))
            if not pid_alive(pid) or (ours and pid == os.getpid()):
                found.append((m, p))
    return found
