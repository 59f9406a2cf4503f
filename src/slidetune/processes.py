"""Whether a process is alive: the check behind every cleanup of what a killed run left (its
checkpoint and export temporaries, its disk tier's scratch files, its shared host state)."""
from __future__ import annotations

import os
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """True for this process, for a live one, and where the answer is unknown (another user's
    process: PermissionError; any other OSError): only a process known gone is taken for dead."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def dead_runs(directory: str | os.PathLike, prefix: str) -> list[Path]:
    """The entries of `directory` named `<prefix><pid>-...` whose process is known gone (pid_alive):
    what runs killed mid-way left there. Names that do not parse are not ours and are left alone."""
    out = []
    d = Path(directory)
    for entry in sorted(d.glob(f"{prefix}*")) if d.is_dir() else []:
        try:
            pid = int(entry.name[len(prefix):].split("-")[0])
        except ValueError:
            continue
        if not pid_alive(pid):
            out.append(entry)
    return out
