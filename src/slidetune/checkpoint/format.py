"""The checkpoint's on-disk format: its names and versions, its errors, a checkpoint directory's
name, and the two small files of a resumable save that the rest of the package reads and writes
whole: `trainer_state/state.json` (state_record, read_state) and `trainer_state/rng.pt` (rng_state,
read_rng, restore_rng). The layout itself: the package docstring (checkpoint/__init__.py)."""
from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import torch

from .. import __version__

# 2 (2026-11-28): the optimizer state may be in parts (writer.optimizer_parts), which a reader of 1 would
# call missing; a checkpoint of version 1 is read as it always was.
FORMAT_VERSION = 2
READ_FORMAT_VERSIONS = (1, 2)
COMPLETE = "COMPLETE"
MANIFEST = "MANIFEST.json"
DIGEST = "xxh3_128"        # xxhash's XXH3 128-bit: 11 GB/s on one core (NOTES "Checkpoint digests")
STATE_DIR = "trainer_state"
OPTIM_FILE = "optimizer.safetensors"
SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# The moments' safetensors dtype for each --moments (engine/adamw.py OPTIMIZER_STATES); the 8-bit
# scales and the step are FP32, and so are the moments of units updated on the GPU in any format
MOMENT_DTYPES = {"fp32": "F32", "bf16": "BF16", "8bit": "U8"}
# the safetensors header's dtype code of each torch dtype a checkpoint may hold
ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}
# a checkpoint directory's name in a run directory (checkpoint_dir)
CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says what and where."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint's own files are damaged or inconsistent (a digest, a size, a type): `file` is the
    one that failed. Not raised for a checkpoint that is whole but of another model or format."""

    def __init__(self, ckpt: Path, file: Path | str, what: str):
        self.ckpt, self.file, self.what = Path(ckpt), Path(file), what
        super().__init__(f"checkpoint {ckpt} is damaged: {file}: {what}")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """Where the checkpoint of `step` lives in a run directory."""
    return Path(run_dir) / f"checkpoint-{step}"


# --------------------------------------------------------------------------- state.json
def state_record(engine, step: int, *, save_dtype: str, with_optimizer: bool,
                 trainer_state: dict | None) -> tuple[dict, str]:
    """state.json's record of a save and its text (TypeError: trainer_state is not JSON-serializable)."""
    state = {
        "format_version": FORMAT_VERSION,
        "slidetune_version": __version__,
        "step": int(step),
        "engine_step": int(engine.step_index),
        "save_dtype": save_dtype,
        "with_optimizer": bool(with_optimizer),
        # the host units' moments (--moments); a checkpoint without the field holds FP32 ones
        "moments": engine.host_state.moments,
        "master": engine.host_state.master,
        "time": time.time(),
        "trainer_state": dict(trainer_state or {}),
    }
    try:
        return state, json.dumps(state, indent=2)
    except TypeError as e:
        raise TypeError(f"trainer_state must be JSON-serializable: {e}") from e


def read_json(ckpt: Path, path: Path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointCorrupt(ckpt, path, "missing") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorrupt(ckpt, path, f"not valid JSON ({e})") from None


def read_state(ckpt: Path) -> dict:
    """trainer_state/state.json, with the type of every field a resume reads checked."""
    path = ckpt / STATE_DIR / "state.json"
    if not path.exists():
        raise CheckpointError(f"checkpoint {ckpt} has no {STATE_DIR}/state.json: it is a model export, "
                              f"not a resumable checkpoint")
    state = read_json(ckpt, path)
    if not isinstance(state, dict):
        raise CheckpointCorrupt(ckpt, path, f"holds a JSON {type(state).__name__}, not an object")
    version = state.get("format_version")
    if type(version) is not int:
        raise CheckpointCorrupt(ckpt, path, f"format_version is {version!r}, not an integer")
    if version not in READ_FORMAT_VERSIONS:
        raise CheckpointError(f"checkpoint {ckpt} has format version {version}, this slidetune reads versions "
                              f"{', '.join(map(str, READ_FORMAT_VERSIONS))}"
                              + (": a newer slidetune wrote it" if version > max(READ_FORMAT_VERSIONS) else ""))
    for key, kind, ok in (("step", "a non-negative integer", lambda v: type(v) is int and v >= 0),
                          ("with_optimizer", "a boolean", lambda v: isinstance(v, bool)),
                          ("trainer_state", "an object", lambda v: isinstance(v, dict))):
        if key not in state and key != "step":
            continue
        if not ok(state.get(key)):
            raise CheckpointCorrupt(ckpt, path, f"{key} is {state.get(key)!r}, not {kind}")
    return state


# --------------------------------------------------------------------------- RNG
def rng_state() -> dict:
    """Every RNG a training loop may draw from, in types torch.load(weights_only=True) accepts."""
    import numpy as np
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch_cpu": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    import numpy as np
    torch.set_rng_state(state["torch_cpu"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    cuda = state.get("torch_cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def read_rng(ckpt: Path) -> dict | None:
    """trainer_state/rng.pt (None if absent: it is optional), every RNG state's type and size checked."""
    path = ckpt / STATE_DIR / "rng.pt"
    if not path.exists():
        return None
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load raises many kinds on a damaged file
        raise CheckpointCorrupt(ckpt, path, f"unreadable ({type(e).__name__}: {str(e).splitlines()[0][:200]})") \
            from None
    problem = _rng_problem(state)
    if problem:
        raise CheckpointCorrupt(ckpt, path, problem)
    return state


def _rng_problem(state) -> str | None:
    """What is wrong with a loaded rng.pt (None: it restores as restore_rng expects)."""
    def byte_state(t, n):
        return isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 and (n is None or t.numel() == n)
    if not isinstance(state, dict):
        return f"holds a {type(state).__name__}, not a dict of RNG states"
    cpu = state.get("torch_cpu")
    n_cpu = torch.get_rng_state().numel()
    if not byte_state(cpu, n_cpu):
        got = f"a {cpu.dtype} tensor of shape {tuple(cpu.shape)}" if isinstance(cpu, torch.Tensor) else repr(type(cpu))
        return f"torch_cpu is {got}, not a uint8 tensor of {n_cpu} bytes"
    py = state.get("python")
    if not (isinstance(py, (tuple, list)) and len(py) == 3 and type(py[0]) is int
            and isinstance(py[1], (tuple, list)) and len(py[1]) == 625 and all(type(v) is int for v in py[1])
            and (py[2] is None or isinstance(py[2], float))):
        return "python is not a `random.getstate()` tuple (version, 625 ints, gauss)"
    n = state.get("numpy")
    if not (isinstance(n, dict) and isinstance(n.get("kind"), str) and isinstance(n.get("keys"), torch.Tensor)
            and n["keys"].dtype == torch.int64 and n["keys"].shape == (624,) and type(n.get("pos")) is int
            and type(n.get("has_gauss")) is int and isinstance(n.get("cached_gaussian"), float)):
        return "numpy is not a numpy RNG state (kind, 624 int64 keys, pos, has_gauss, cached_gaussian)"
    cuda = state.get("torch_cuda")
    if cuda is not None and not (isinstance(cuda, (list, tuple)) and all(byte_state(t, None) for t in cuda)):
        return "torch_cuda is not a list of uint8 tensors"
    return None
