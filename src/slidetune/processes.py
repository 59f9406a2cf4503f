"""Whether a process is alive: the check behind every cleanup of what a killed run left (its
checkpoint and export temporaries, its disk tier's scratch files)."""
from __future__ import annotations

import os


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
