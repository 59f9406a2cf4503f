"""One configuration per process: `python -m MODULE SPEC.json OUT.json`, result read back as JSON.

A worker module exposes `main(argv)` via `worker_main(fn)`: fn(spec: dict) -> dict. Exceptions
become status "error", torch.OutOfMemoryError becomes status "oom" with the size the
allocator asked for (parsed from the message), and a process that dies without writing
(host OOM killer, segfault) becomes status "crashed" with its exit code.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

_OOM_ASK = re.compile(r"Tried to allocate ([0-9.]+) ?([KMGT]i?B)", re.I)
_OOM_TOTAL = re.compile(r"total capacity of ([0-9.]+) ?([KMGT]i?B)", re.I)
_UNIT = {"k": 2**-20, "m": 2**-10, "g": 1.0, "t": 2**10}


def _gib(num: str, unit: str) -> float:
    return float(num) * _UNIT[unit[0].lower()]


def parse_oom(message: str) -> dict:
    """'CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.1 GiB ...'
    -> {'requested_gib': 2.0, 'capacity_gib': 79.1} (keys only for what the message holds)."""
    out = {}
    m = _OOM_ASK.search(message or "")
    if m:
        out["requested_gib"] = _gib(*m.groups())
    m = _OOM_TOTAL.search(message or "")
    if m:
        out["capacity_gib"] = _gib(*m.groups())
    return out


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    try:
        import torch
        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except ImportError:
        pass
    return "out of memory" in str(exc).lower()


def run_worker(module: str, spec: dict, timeout_s: float = 3600, env: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory() as d:
        spec_path, out_path = Path(d) / "spec.json", Path(d) / "result.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", module, str(spec_path), str(out_path)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                                  env={**os.environ, **(env or {})})
        except subprocess.TimeoutExpired:
            return {"spec": spec, "status": "timeout", "error": f"exceeded {timeout_s} s"}
        if out_path.exists():
            return json.loads(out_path.read_text())
        return {"spec": spec, "status": "crashed", "returncode": proc.returncode,
                "error": (proc.stderr or "")[-2000:]}


def worker_main(fn, argv: list[str] | None = None) -> int:
    argv = argv if argv is not None else sys.argv[1:]
    spec = json.loads(Path(argv[0]).read_text())
    out = Path(argv[1])
    try:
        result = fn(spec)
    except BaseException as e:  # noqa: BLE001 - every failure is a result
        if is_oom(e):
            msg = str(e)
            result = {"spec": spec, "status": "oom", "error": msg.splitlines()[0] if msg else type(e).__name__,
                      **{f"oom_{k}": v for k, v in parse_oom(msg).items()}}
            try:
                import torch
                if torch.cuda.is_available():
                    result["gpu_peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
                    result["gpu_peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
            except Exception:  # noqa: BLE001
                pass
        else:
            result = {"spec": spec, "status": "error", "error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc()[-4000:]}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=float))
    os.replace(tmp, out)
    return 0 if result.get("status") == "ok" else 1
