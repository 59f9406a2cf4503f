"""One configuration per process: `python -m MODULE SPEC.json OUT.json`, result read back as JSON.

A worker module exposes `main(argv)` via `worker_main(fn)`: fn(spec: dict) -> dict. Exceptions
become status "error", torch.OutOfMemoryError becomes status "oom" with the size the
allocator asked for (parsed from the message), and a process that dies without writing
(host OOM killer, segfault) becomes status "crashed" with its exit code.
`run_worker(..., ranks=N)` runs the module on N ranks of this host under torchrun (data-parallel
slide, the collective probe): rank 0 writes the result, a failing rank its reason beside it.
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


def run_worker(module: str, spec: dict, timeout_s: float = 3600, env: dict | None = None, ranks: int = 1,
               show_stderr: bool = False) -> dict:
    """`python -m MODULE SPEC.json OUT.json` in a fresh process; ranks > 1: under torchrun on that many
    ranks of this host (launch.torchrun_prefix), each rank running the module, rank 0 writing OUT.json
    (rank_output). show_stderr: the worker's stderr goes to this process's as it is written (its
    progress; a crash's message is then above, not in the result)."""
    with tempfile.TemporaryDirectory() as d:
        spec_path, out_path = Path(d) / "spec.json", Path(d) / "result.json"
        spec_path.write_text(json.dumps(spec))
        if ranks > 1:
            return _run_ranks(module, spec, spec_path, out_path, ranks, timeout_s, env)
        cmd = [sys.executable, "-m", module, str(spec_path), str(out_path)]
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None if show_stderr else subprocess.PIPE,
                                  text=True, timeout=timeout_s, env={**os.environ, **(env or {})})
        except subprocess.TimeoutExpired:
            return {"spec": spec, "status": "timeout", "error": f"exceeded {timeout_s} s"}
        if out_path.exists():
            return json.loads(out_path.read_text())
        return {"spec": spec, "status": "crashed", "returncode": proc.returncode,
                "error": (proc.stderr or "(its messages are above)")[-2000:]}


def rank_output(out: Path, rank: int) -> Path:
    """Where a rank's worker writes: OUT.json for rank 0 (the run's result), OUT.json.rankR for the
    others (only when they fail: their reason, where rank 0 may be killed before it writes)."""
    return out if rank == 0 else out.with_name(f"{out.name}.rank{rank}")


def _run_ranks(module: str, spec: dict, spec_path: Path, out_path: Path, ranks: int, timeout_s: float,
               env: dict | None) -> dict:
    """The worker on `ranks` ranks under torchrun in a session of its own: a timeout ends torchrun
    and every rank (killpg), not torchrun alone. The result is rank 0's; a failing rank's message is
    added (or is the result, when rank 0 wrote none: torchrun ends the others when one fails)."""
    from ...parallel.launch import rank_threads_env, torchrun_prefix
    cmd = [*torchrun_prefix(ranks), "-m", module, str(spec_path), str(out_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=rank_threads_env(ranks, {**os.environ, **(env or {})}), start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        return {"spec": spec, "status": "timeout", "error": f"exceeded {timeout_s} s", "world_size": ranks}
    failed = {}
    for r in range(1, ranks):
        path = rank_output(out_path, r)
        if path.exists():
            failed[r] = json.loads(path.read_text())
    if out_path.exists():
        result = json.loads(out_path.read_text())
    elif failed:
        r, first = next(iter(failed.items()))
        result = {**first, "error": f"rank {r}: {first.get('error')}"}
    else:
        result = {"spec": spec, "status": "crashed", "returncode": proc.returncode, "error": (log or "")[-2000:]}
    if failed:
        result["rank_errors"] = {str(r): f"{v.get('status')}: {v.get('error')}" for r, v in failed.items()}
    return result


def worker_main(fn, argv: list[str] | None = None) -> int:
    argv = argv if argv is not None else sys.argv[1:]
    spec = json.loads(Path(argv[0]).read_text())
    rank = int(os.environ.get("RANK", "0"))      # under torchrun (run_worker(ranks=N)): rank 0 writes OUT
    out = rank_output(Path(argv[1]), rank)
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
    ok = result.get("status") == "ok"
    if rank == 0 or not ok:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=float))
        os.replace(tmp, out)
    return 0 if ok else 1
