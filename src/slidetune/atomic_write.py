"""Replace a file as one operation: a reader (or a run killed midway) sees the old file or the new one."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def write_atomically(path: Path, write: Callable[[Path], object], tmp: Path | None = None) -> None:
    """`write(tmp)`, then rename tmp (default `<path>.tmp`) over `path`. An OSError (a full disk)
    removes tmp and is raised again naming `path`."""
    tmp = tmp or path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, f"could not write {path}: {e.strerror or e} (the previous {path.name}, if any, "
                               f"is unchanged)") from e
