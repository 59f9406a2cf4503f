"""Reading a checkpoint back: load_checkpoint restores an engine from one, check_checkpoint
verifies one before a resume touches any state, and verify_files checks every file against the
manifest (the read-back that ends each save, too).

Tensors are read one at a time from the memory-mapped safetensors files (_LazyTensors); everything
is validated before the engine is touched. A checkpoint with no trace of a manifest (an older
slidetune's) is held to the model's layout instead (LegacyLayout). The guarantees: the package
docstring, "Integrity"."""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from .format import (COMPLETE, DIGEST, MANIFEST, MOMENT_DTYPES, OPTIM_FILE, ST_DTYPES, STATE_DIR, CheckpointCorrupt,
                     CheckpointError, read_json, read_rng, read_state, restore_rng)
from .io import FileDigest, digests_parallel


# --------------------------------------------------------------------------- loading
class _LazyTensors(Mapping):
    """name -> tensor read on access from memory-mapped safetensors files (one at a time)."""

    def __init__(self, files: dict[str, Path]):
        self._files = files              # tensor name -> file
        self._handles: dict[Path, object] = {}

    def _handle(self, path: Path):
        if path not in self._handles:
            from safetensors import safe_open
            self._handles[path] = safe_open(str(path), "pt")
        return self._handles[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self._files[name]).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return self._handle(self._files[name]).get_slice(name).get_dtype()

    def file(self, name: str) -> Path | None:
        """The file holding tensor `name` (None: no such tensor)."""
        return self._files.get(name)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise KeyError(name)
        return self._handle(self._files[name]).get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def _weight_files(ckpt: Path) -> dict[str, Path]:
    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(ckpt, index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
            raise CheckpointCorrupt(ckpt, index, "has no \"weight_map\" object of tensor name -> file name")
        files = {k: ckpt / v for k, v in weight_map.items()}
        missing = sorted({str(p) for p in files.values() if not p.exists()})
        if missing:
            raise CheckpointCorrupt(ckpt, index, f"lists shard(s) that are missing: {missing}")
        return files
    single = ckpt / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"checkpoint {ckpt} has neither model.safetensors nor model.safetensors.index.json")
    return _file_keys(single)


def _file_keys(path: Path) -> dict[str, Path]:
    """Tensor name -> `path` for every tensor of a safetensors file (its header parsed and checked
    against the file's size by safetensors: a truncated or garbled file is CheckpointCorrupt)."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), "pt") as f:
            return {k: path for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - SafetensorError (not an OSError) or an OSError
        ckpt = path.parent.parent if path.parent.name == STATE_DIR else path.parent
        raise CheckpointCorrupt(ckpt, path, f"not a readable safetensors file ({e})") from None


def optimizer_files(ckpt: Path) -> list[Path]:
    """The optimizer state's files of checkpoint `ckpt`: OPTIM_FILE, or every part of
    optimizer-0000i-of-0000N; CheckpointCorrupt names one that is missing."""
    sdir = ckpt / STATE_DIR
    single = sdir / OPTIM_FILE
    parts = sorted(sdir.glob("optimizer-*-of-*.safetensors")) if sdir.is_dir() else []
    if single.exists() and not parts:
        return [single]
    if not parts:
        raise CheckpointCorrupt(ckpt, single, "missing (state.json says the optimizer state was saved)")
    if single.exists():
        raise CheckpointCorrupt(ckpt, parts[0], f"beside {OPTIM_FILE}: the optimizer state is in one file or in "
                                                "parts, never both")
    m = re.fullmatch(r"optimizer-\d{5}-of-(\d{5})\.safetensors", parts[0].name)
    n = int(m.group(1)) if m else 0
    want = [sdir / f"optimizer-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    for path in want:
        if not path.exists():
            raise CheckpointCorrupt(ckpt, path, f"missing (the optimizer state is in {n} parts)")
    extra = sorted(set(parts) - set(want))
    if extra or not want:
        raise CheckpointCorrupt(ckpt, (extra or parts)[0], f"not one of the optimizer state's {n} parts")
    return want


def load_checkpoint(engine, ckpt_dir: Path, *, checked: bool = False) -> dict:
    """Restore weights, optimizer state, step and RNG states from a checkpoint into `engine`.

    Validates everything before touching the engine: the checkpoint itself (`check_checkpoint`:
    its files against the manifest, then the type of each; skipped when `checked`, i.e. the caller
    has just run it), then every engine parameter and optimizer tensor against the engine's
    (present, right shape and dtype). Returns the `trainer_state` dict given to `save_checkpoint`
    plus "step"; the torch/CUDA/python/numpy RNG states are already restored.
    """
    ckpt = Path(ckpt_dir)
    if not checked:
        check_checkpoint(ckpt)
    state = read_state(ckpt)
    engine.synchronize()
    masters = _LazyTensors(_weight_files(ckpt))
    # shapes only: the GPU-held masters stay where they are (an 8B on an H200 keeps 89 GiB there)
    want = {name: (tuple(t.shape), None) for name, t in engine.named_master_params(on_host=False)}
    buffers = dict(engine.named_buffers())       # models/buffers.py: saved beside the weights
    want.update({name: (tuple(t.shape), None) for name, t in buffers.items()})
    optim = _LazyTensors({k: p for path in optimizer_files(ckpt) for k, p in _file_keys(path).items()})
    want_optim = {key: (tuple(t.shape), ST_DTYPES.get(t.dtype, str(t.dtype)))
                  for key, t in engine.optimizer_tensors(on_host=False).items()}
    problem = _tensors_problem(masters, want, "tensor", "model", no_extra=True)
    if problem is not None:
        raise CheckpointError(f"checkpoint {ckpt}: {problem[1]}")
    problem = _tensors_problem(optim, want_optim, "optimizer tensor", "engine")
    if problem is not None:
        raise CheckpointError(f"checkpoint {ckpt}: {problem[1]} (a checkpoint resumes with the --moments it was "
                              f"saved with: {_moments_of(optim)})")
    saved_master = state.get("master", "fp32")
    if saved_master != engine.host_state.master:
        # FP32 weights either way: a BF16 master would round an FP32 one's, and an FP32 master
        # would not go on with the rounding stream the run was taking
        raise CheckpointError(f"checkpoint {ckpt}: saved with --master {saved_master}, and this run keeps "
                              f"--master {engine.host_state.master}: a checkpoint resumes with the state format it was "
                              f"saved with")
    rng = read_rng(ckpt)

    engine.load_state(masters, optim, int(state["step"]))
    engine.load_buffers({name: masters[name] for name in buffers})
    if rng is not None:
        restore_rng(rng)
    out = dict(state.get("trainer_state") or {})
    out.setdefault("step", int(state["step"]))
    return out


_Want = Mapping[str, tuple[tuple[int, ...], str | None]]      # tensor name -> (shape, safetensors dtype or None: any)


def _tensors_problem(tensors: _LazyTensors, want: _Want, label: str, expecter: str,
                    no_extra: bool = False) -> tuple[str, str] | None:
    """What first keeps a checkpoint's `tensors` (one kind: weights or optimizer state, `label`
    naming one in the message) from being what the `expecter` ("model", "engine") wants: a tensor
    missing, of another shape or dtype, or (`no_extra`) one it does not have. (name, message), or
    None when they match. Headers only: no tensor is read."""
    for name, (shape, dtype) in want.items():
        if name not in tensors:
            return name, f"{label} {name!r} is missing"
        if tensors.shape(name) != shape:
            return name, f"{label} {name!r} has shape {tensors.shape(name)}, the {expecter} expects {shape}"
        if dtype is not None and tensors.dtype(name) != dtype:
            return name, (f"{label} {name!r} is {tensors.dtype(name)}, the {expecter} keeps {dtype}: it cannot be "
                          f"resumed exactly")
    extra = sorted(set(tensors) - set(want)) if no_extra else []
    if extra:
        return extra[0], (f"it holds tensors the {expecter} does not have (another model?): "
                          f"{extra[:5]}{' ...' if len(extra) > 5 else ''}")
    return None


# --------------------------------------------------------------------------- verification
@dataclass(frozen=True)
class CheckedCheckpoint:
    """What `check_checkpoint` found: a checkpoint a resume can load."""
    path: Path
    step: int
    verified: bool                 # its files matched MANIFEST.json (False: none, an older slidetune's)


@dataclass(frozen=True)
class LegacyLayout:
    """The tensors an older slidetune's resumable checkpoint of one model holds (one written before
    the manifest: nothing vouches for its bytes, so `check_checkpoint` holds its headers to this
    before it is used): every parameter by its HF name and shape, and each unit's AdamW state as
    those versions wrote it (exp_avg and exp_avg_sq flat over the unit, step a scalar), all FP32."""
    weights: dict[str, tuple[int, ...]]
    optimizer: dict[str, tuple[int, ...]]

    @classmethod
    def of_units(cls, units: Iterable) -> LegacyLayout:
        """From the model's units (models/units.py UnitSpec: name, numel, params with full_name and shape)."""
        units = list(units)
        weights = {p.full_name: tuple(p.shape) for u in units for p in u.params}
        optimizer = {f"{u.name}.{k}": shape for u in units
                     for k, shape in (("exp_avg", (u.numel,)), ("exp_avg_sq", (u.numel,)), ("step", ()))}
        return cls(weights, optimizer)


def _optimizer_dtypes(state: dict, name: str) -> tuple[str, ...]:
    """The dtypes optimizer tensor `name` may have in a checkpoint whose state.json is `state`."""
    if name.endswith((".exp_avg", ".exp_avg_sq")):
        return tuple(dict.fromkeys(("F32", MOMENT_DTYPES.get(state.get("moments", "fp32"), "F32"))))
    return ("F32",)


def _moments_of(optim: _LazyTensors) -> str:
    """The --moments a checkpoint's optimizer state was saved with, from its first exp_avg's dtype."""
    kinds = {v: k for k, v in MOMENT_DTYPES.items()}
    for name in optim:
        if name.endswith(".exp_avg"):
            return f"this one holds --moments {kinds.get(optim.dtype(name), optim.dtype(name))}"
    return "this one holds no moments"


def check_checkpoint(ckpt_dir: Path, legacy: LegacyLayout | None = None) -> CheckedCheckpoint:
    """Everything about a checkpoint that needs no engine, before a resume touches any state: the
    COMPLETE marker; every file's size and digest against MANIFEST.json (`verify_files`), and every
    file a resume reads listed there; then what each file a resume reads holds: state.json (an
    object with the right types), config.json, the weights' and the optimizer's safetensors headers
    (every tensor F32), rng.pt (the RNG states' types and sizes). A checkpoint with no trace of a
    manifest (an older slidetune's) is, with `legacy` (the model's layout), also held to it: every
    tensor's name, shape and dtype, as no digest vouches for its bytes. CheckpointCorrupt names the
    file and what is wrong; a CheckpointError a checkpoint that is whole but cannot be resumed (a
    model export, another format version)."""
    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint directory {ckpt} does not exist")
    if not (ckpt / COMPLETE).exists():
        raise CheckpointError(f"checkpoint {ckpt} has no {COMPLETE} marker: it was not finished "
                              f"(interrupted save) or is not a slidetune checkpoint")
    listed = _verified_files(ckpt)
    state = read_state(ckpt)
    if not state.get("with_optimizer", False):
        raise CheckpointError(f"checkpoint {ckpt} cannot be resumed exactly: it was saved without optimizer state "
                              f"(save_dtype={state.get('save_dtype')!r}, with_optimizer={state.get('with_optimizer')})"
                              f". Load it as a model directory (weights only) to start a new run from it")
    optim_files = optimizer_files(ckpt)
    weight_files = sorted(set(_weight_files(ckpt).values()))
    if listed is not None:
        _check_listed(ckpt, listed, [*weight_files, *optim_files])
    config = ckpt / "config.json"
    if not isinstance(read_json(ckpt, config), dict):
        raise CheckpointCorrupt(ckpt, config, "not a JSON object")
    # FP32 weights; the optimizer's moments in the format state.json records (--moments)
    for what, files in (("weights", weight_files), ("optimizer", optim_files)):
        for path in sorted(files):
            tensors = _LazyTensors(_file_keys(path))
            for name in tensors:
                kinds = ("F32",) if what == "weights" else _optimizer_dtypes(state, name)
                if tensors.dtype(name) not in kinds:
                    raise CheckpointCorrupt(ckpt, path, f"{what} tensor {name!r} is {tensors.dtype(name)}, not "
                                                        f"{' or '.join(kinds)}: a resumable checkpoint holds FP32 "
                                                        f"{what}" + (f" and moments as --moments "
                                                                     f"{state.get('moments', 'fp32')}"
                                                                     if what == "optimizer" else ""))
    if listed is None and legacy is not None:
        _check_legacy_layout(ckpt, legacy, weight_files, optim_files)
    read_rng(ckpt)
    return CheckedCheckpoint(ckpt, int(state["step"]), listed is not None)


def _check_listed(ckpt: Path, listed: set[str], tensor_files: list[Path]) -> None:
    """Every file a resume reads is one the manifest lists (so verified): a manifest that leaves one
    out (edited, and its record in COMPLETE with it) vouches for nothing of its bytes."""
    reads = [*tensor_files, ckpt / "model.safetensors.index.json", ckpt / "config.json",
             ckpt / STATE_DIR / "state.json", ckpt / STATE_DIR / "rng.pt"]
    for path in reads:
        if path.exists() and path.relative_to(ckpt).as_posix() not in listed:
            raise CheckpointCorrupt(ckpt, path, f"not listed in {MANIFEST}, which lists every file this slidetune "
                                                f"writes: its bytes cannot be verified")


def _check_legacy_layout(ckpt: Path, legacy: LegacyLayout, weight_files: list[Path], optim_files: list[Path]) -> None:
    """A checkpoint with no manifest against the model's layout (_tensors_problem, as the loader
    checks against the engine): one that does not fit is CheckpointCorrupt, since nothing tells its
    damage from another model's files (a resume sets it aside and takes the next older one)."""
    for files, want, label in ((weight_files, legacy.weights, "tensor"), (optim_files, legacy.optimizer,
                                                                           "optimizer tensor")):
        tensors = _LazyTensors({k: p for path in files for k, p in _file_keys(path).items()})
        problem = _tensors_problem(tensors, {k: (shape, "F32") for k, shape in want.items()}, label, "model",
                                  no_extra=True)
        if problem is not None:
            name, what = problem
            raise CheckpointCorrupt(ckpt, tensors.file(name) or files[0],
                                    f"{what}; with no {MANIFEST} (written by an older slidetune) its tensors must "
                                    f"fit the model to be trusted")


def verify_files(ckpt_dir: Path, threads: int | None = None) -> bool:
    """Every file MANIFEST.json lists has its recorded size and digest (the manifest itself the one
    COMPLETE records); CheckpointCorrupt names the first (in path order) that does not. The files
    are read at once (io.digests_parallel, `threads` readers). False when there is no
    trace of a manifest (a checkpoint of a slidetune older than it): nothing could be verified."""
    return _verified_files(Path(ckpt_dir), threads) is not None


def _verified_files(ckpt: Path, threads: int | None = None) -> set[str] | None:
    """verify_files' work: the files MANIFEST.json lists (relative paths), each verified, or None for
    a checkpoint with no trace of a manifest. Where COMPLETE records one (this slidetune wrote it),
    a missing MANIFEST.json, or a record that is not {size, digest}, is damage, never "older"."""
    path = ckpt / MANIFEST
    complete = read_json(ckpt, ckpt / COMPLETE)
    if not isinstance(complete, dict):
        raise CheckpointCorrupt(ckpt, ckpt / COMPLETE, f"holds a JSON {type(complete).__name__}, not an object")
    recorded = complete.get(MANIFEST)
    if not path.exists():
        if MANIFEST in complete:
            raise CheckpointCorrupt(ckpt, path, f"missing, though {COMPLETE} records its digest: the slidetune that "
                                                f"wrote this checkpoint wrote one, and without it no file can be "
                                                f"verified")
        return None
    text = path.read_bytes()
    if MANIFEST in complete:
        if not (isinstance(recorded, dict) and type(recorded.get("size")) is int
                and isinstance(recorded.get("digest"), str)):
            raise CheckpointCorrupt(ckpt, ckpt / COMPLETE, f"its record of {MANIFEST} is {recorded!r}, not "
                                                           f"{{size, digest}}")
        got = FileDigest(len(text), xxhash.xxh3_128(text).hexdigest())
        if got.record() != recorded:
            raise CheckpointCorrupt(ckpt, path, f"{got.size} bytes of digest {got.digest}, {COMPLETE} records "
                                                f"{recorded.get('size')} bytes of digest {recorded.get('digest')}")
    manifest = read_json(ckpt, path)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CheckpointCorrupt(ckpt, path, "not a JSON object with a \"files\" object")
    if manifest.get("algorithm") != DIGEST:
        raise CheckpointError(f"checkpoint {ckpt}: {MANIFEST} uses digest {manifest.get('algorithm')!r}; this "
                              f"slidetune knows {DIGEST!r}")
    for rel, entry in sorted(files.items()):
        _check_entry(ckpt, path, rel, entry)
    got = digests_parallel([ckpt / rel for rel in sorted(files)], threads)
    for rel, entry in sorted(files.items()):
        digest = got[ckpt / rel].digest
        if digest != entry["digest"]:
            raise CheckpointCorrupt(ckpt, ckpt / rel, f"its {DIGEST} digest is {digest}, {MANIFEST} records "
                                                      f"{entry['digest']}: its bytes changed after it was written")
    return set(files)


def _check_entry(ckpt: Path, manifest: Path, rel: str, entry) -> None:
    """A manifest entry is {size, digest} and its file is there with that size (CheckpointCorrupt if not)."""
    file = ckpt / rel
    if not (isinstance(entry, dict) and type(entry.get("size")) is int and isinstance(entry.get("digest"), str)):
        raise CheckpointCorrupt(ckpt, manifest, f"the entry of {rel!r} is not {{size, digest}}: {entry!r}")
    if not file.is_file():
        raise CheckpointCorrupt(ckpt, file, f"missing (listed in {MANIFEST})")
    size = file.stat().st_size
    if size != entry["size"]:
        raise CheckpointCorrupt(ckpt, file, f"{size} bytes, {MANIFEST} records {entry['size']} "
                                            f"({'truncated' if size < entry['size'] else 'grown'} since it was "
                                            f"written)")
