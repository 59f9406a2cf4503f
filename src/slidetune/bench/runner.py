"""Run each configuration in its own process (clean peaks) and collect the JSON results."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from .measure import MeasureSpec


def run_isolated(spec: MeasureSpec, timeout_s: float = 1800, env: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory() as d:
        spec_path = Path(d) / "spec.json"
        out_path = Path(d) / "result.json"
        spec_path.write_text(json.dumps(asdict(spec)))
        cmd = [sys.executable, "-m", "slidetune.bench.measure", str(spec_path), str(out_path)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                                  env={**os.environ, **(env or {})})
        except subprocess.TimeoutExpired:
            return {"spec": asdict(spec), "status": "timeout", "error": f"exceeded {timeout_s} s"}
        if out_path.exists():
            result = json.loads(out_path.read_text())
        else:
            # Killed before writing (e.g. the host OOM killer): say so with the exit code.
            result = {"spec": asdict(spec), "status": "crashed", "returncode": proc.returncode,
                      "error": (proc.stderr or "")[-2000:]}
        return result
