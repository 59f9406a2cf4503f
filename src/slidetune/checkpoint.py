"""Checkpoints: a HF model directory plus the state needed to resume a run exactly.

Layout of one checkpoint (`<run_dir>/checkpoint-<step>/`):

    config.json                      HF config (dtype = the saved dtype, no quantization_config)
    generation_config.json           when the config carries generation defaults
    model.safetensors                weights, or shards model-0000i-of-0000N.safetensors
    model.safetensors.index.json       + index {"metadata": {"total_size"}, "weight_map"}
    tokenizer files                  when a tokenizer is given
    trainer_state/optimizer.safetensors   the engine's AdamW state (FP32 moments + step per unit),
      or optimizer-0000i-of-0000N.safetensors   in N parts of the units in order, written at once
    trainer_state/state.json         step, trainer state, slidetune and format versions
    trainer_state/rng.pt             torch CPU (+ CUDA), python `random` and numpy RNG states
    MANIFEST.json                    every file above: size and xxh3-128 digest
    COMPLETE                         written last: the directory is whole (and the manifest's digest)

so `AutoModelForCausalLM.from_pretrained(dir)` loads it as is.

Atomicity: everything is written into a sibling `<name>.tmp-<pid>`, every file fsynced,
then the COMPLETE marker, then the directory is renamed to its final name (an existing
one is first renamed to `<name>.old-<pid>` and deleted after). A crash or an error
(disk full) leaves the previous checkpoint as it was; the temporary directory is removed.
When an existing directory of the same name is overwritten, a crash between its two
renames leaves the old checkpoint whole in `<name>.old-<pid>` and the new one whole in
`<name>.tmp-<pid>` (both with COMPLETE): never a mix of the two.

Integrity: each file's digest is computed as it is written (the weights and moments as their
bytes pass to write(), no second read; the small files after writing) and recorded in
MANIFEST.json. Before the rename the new directory is read back from the disk (its pages were
dropped from the page cache after the fsync) and checked against the manifest: a checkpoint that
does not read back as written is set aside as `<name>.corrupt-<time>` and the save fails, so a
pruning never follows an unverified save. `check_checkpoint` verifies a directory before a resume
uses it (sizes, digests, then the type, dtype and structure of every file it reads):
`CheckpointCorrupt` names the file and what is wrong; `set_aside` renames such a checkpoint
(never deletes it). Where COMPLETE records the manifest's digest (every checkpoint this version
writes), a missing or altered MANIFEST.json, or a file a resume reads that it does not list, is
damage like any other. Only a checkpoint with no trace of a manifest (written before it existed)
loads unverified, once its tensors' names, shapes and dtypes fit the model (`LegacyLayout`), with
a warning. benchmarks/NOTES.md "Checkpoint digests" has the digest's and the
read-back's cost.

Memory: tensors are written one at a time straight from the engine's FP32 masters and
moments (views, no copy; write_safetensors streams a safetensors file, where
safetensors.torch.save_file first builds every tensor's bytes in RAM: 65 GB for an 8B's
moments); a BF16 export converts 64 MiB at a time, and state kept on the GPU comes to the
host through two pinned 64 MiB buffers per file being written (checkpoint_io: the writer's
threads, the staging, the parallel read-back). Loading reads one tensor at a time from the
memory-mapped files, so neither side ever holds a second copy of the model.
"""
from __future__ import annotations

import copy
import json
import os
import random
import re
import shutil
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from . import __version__
from .checkpoint_io import FileDigest, ParallelFile, Stager, digests_parallel, host_pieces, io_pool, run_streams
from .engine.slide.disk_tier import StreamedTensor
from .faults import maybe_corrupt, maybe_fail
from .processes import pid_alive

# 2 (2026-11-28): the optimizer state may be in parts (optimizer_parts), which a reader of 1 would
# call missing; a checkpoint of version 1 is read as it always was.
FORMAT_VERSION = 2
READ_FORMAT_VERSIONS = (1, 2)
COMPLETE = "COMPLETE"
MANIFEST = "MANIFEST.json"
DIGEST = "xxh3_128"        # xxhash's XXH3 128-bit: 11 GB/s on one core (NOTES "Checkpoint digests")
STATE_DIR = "trainer_state"
OPTIM_FILE = "optimizer.safetensors"
# Buffered writes into one file run one at a time (the file's inode lock): 8 threads into one file
# wrote at one thread's rate, into 8 files 1.3x (tmpfs) to 1.6x (ext4's page cache) faster
# (benchmarks/NOTES.md "Checkpoint writer"). AdamW's moments are twice the weights, so the optimizer
# state of a large checkpoint goes out as two files beside the weights' stream: three streams of
# equal bytes instead of one file of two thirds of them. A small one stays one file.
OPTIM_PARTS = 2
OPTIM_PARTS_FROM_BYTES = 4 * 2**30
SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")
_LEFTOVER_RE = re.compile(r"^(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)$")


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


# --------------------------------------------------------------------------- saving
def save_checkpoint(engine, out_dir: Path, *, step: int, tokenizer=None, trainer_state: dict | None = None,
                    save_dtype: str = "fp32", with_optimizer: bool = True,
                    max_shard_bytes: int = 5 * 2**30, writer_threads: int | None = None,
                    stream_s: dict[str, float] | None = None) -> Path:
    """Write a complete, atomic checkpoint of `engine` to `out_dir`; returns `out_dir`.

    save_dtype:
      "fp32"  the FP32 master weights as they are; with the optimizer state and the RNG
              states the run resumes exactly (bit for bit) from `load_checkpoint`.
      "bf16"  a half-size export for inference or a new fine-tune. The weights are rounded
              to BF16 and the optimizer state is not written (`with_optimizer` is ignored
              and becomes False), so exact resumption is impossible: `load_checkpoint`
              refuses such a directory; load it as a model instead.
    trainer_state: JSON-serializable dict (data position, scheduler, metrics ...), returned
      by `load_checkpoint`.
    max_shard_bytes: weights are split into shards of at most this many bytes (a single
      larger tensor gets a shard of its own), with a HF index when there is more than one.
    writer_threads: the writer's and the read-back's I/O threads (None: checkpoint_io.default_threads()).
    stream_s: filled with each tensor stream's seconds (write_tensor_files), where given.
    """
    if save_dtype not in SAVE_DTYPES:
        raise ValueError(f"save_dtype must be one of {sorted(SAVE_DTYPES)}, not {save_dtype!r}")
    if max_shard_bytes <= 0:
        raise ValueError("max_shard_bytes must be positive")
    if save_dtype != "fp32":
        with_optimizer = False
    state, state_text = state_record(engine, step, save_dtype=save_dtype, with_optimizer=with_optimizer,
                                     trainer_state=trainer_state)
    dtype = SAVE_DTYPES[save_dtype]

    def write(tmp: Path) -> None:
        _write_complete(engine, tmp, step=int(step), tokenizer=tokenizer, state=state, state_text=state_text,
                        dtype=dtype, with_optimizer=with_optimizer, max_shard_bytes=max_shard_bytes,
                        threads=writer_threads, stream_s=stream_s)
    return save_atomically(Path(out_dir), write)


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


def _write_complete(engine, tmp: Path, *, step: int, tokenizer, state: dict, state_text: str,
                    dtype: torch.dtype, with_optimizer: bool, max_shard_bytes: int, threads: int | None,
                    stream_s: dict[str, float] | None = None) -> None:
    """Write the whole checkpoint into the fresh directory `tmp`, synced and read back: the tensor
    files (weights and optimizer state as streams written at once), then finish_checkpoint. Raises on
    any failure; the caller renames `tmp` into place only after this returns."""
    fresh_dir(tmp)
    engine.synchronize()     # the deferred schedule's update sweep may still be running
    optim, lock = None, threading.Lock()
    if with_optimizer:
        (tmp / STATE_DIR).mkdir()
        optim = {k: one_reader(t, lock) for k, t in engine.optimizer_tensors(on_host=False).items()}
    # a device unit's masters left on the device: the writer stages them through pinned memory
    weights = ((name, one_reader(t, lock)) for name, t in engine.named_master_params(on_host=False))
    streamed = write_tensor_files(weights, optim, tmp, dtype, max_shard_bytes, threads=threads, step=step,
                                  stream_s=stream_s)
    finish_checkpoint(engine, tmp, step=step, tokenizer=tokenizer, state=state, state_text=state_text, dtype=dtype,
                      streamed=streamed, rng=rng_state(), threads=threads)


def one_reader(t: torch.Tensor | StreamedTensor, lock: threading.Lock) -> torch.Tensor | StreamedTensor:
    """`t`, a disk tier's StreamedTensor read under `lock`: its blocks are taken one reader at a
    time (DiskTier.acquire), and the streams of a save read a disk unit's master and moments."""
    if not isinstance(t, StreamedTensor):
        return t

    def source() -> Iterator[torch.Tensor]:
        parts = t.chunks()
        while True:
            with lock:
                part = next(parts, None)
            if part is None:
                return
            yield part
    return StreamedTensor(tuple(t.shape), t.dtype, source)


def write_tensor_files(weights: Iterable[tuple[str, torch.Tensor | StreamedTensor]],
                       optim: Mapping[str, torch.Tensor | StreamedTensor] | None, directory: Path,
                       dtype: torch.dtype, max_shard_bytes: int, *, threads: int | None = None, step: int = 0,
                       cancel: threading.Event | None = None,
                       stream_s: dict[str, float] | None = None) -> dict[str, FileDigest]:
    """A checkpoint's tensor files as streams written at once, sharing one pool of `threads`
    writers: the weight shards (write_weights, one after another) here, and each of the optimizer
    state's files (`optim` in optimizer_parts, into STATE_DIR, which exists) in a thread of its
    own. A failure of any stops the others at their next piece and is raised once all have ended.
    Their digests by path relative to `directory`; `stream_s` (where given) gets each stream's
    seconds from the start to its last byte ("weights", and each optimizer file's name): the one
    that ends last is what bound the write."""
    cancel = cancel or threading.Event()
    parts = optimizer_parts(optim) if optim is not None else []
    times = stream_s if stream_s is not None else {}
    t0 = time.monotonic()
    with io_pool(None, threads) as pool:
        def weights_stream() -> dict[str, FileDigest]:
            out = write_weights(weights, directory, dtype, max_shard_bytes, pool=pool, cancel=cancel)
            maybe_fail("checkpoint", step)          # tests only (faults.py): a writer failing mid-save
            times["weights"] = time.monotonic() - t0
            return out

        def optim_stream(name: str, tensors: dict) -> Callable[[], FileDigest]:
            def run() -> FileDigest:
                digest = save_tensors(tensors, directory / STATE_DIR / name, pool=pool, cancel=cancel)
                times[name] = time.monotonic() - t0
                return digest
            return run
        streamed, digests = run_streams(weights_stream, [optim_stream(n, t) for n, t in parts], cancel)
    for (name, _), digest in zip(parts, digests):
        streamed[f"{STATE_DIR}/{name}"] = digest
    return streamed


def optimizer_parts(optim: Mapping[str, torch.Tensor | StreamedTensor]) -> list[tuple[str, dict]]:
    """The optimizer state's files, (name, tensors) in order: one OPTIM_FILE below
    OPTIM_PARTS_FROM_BYTES, else OPTIM_PARTS runs of the tensors in order (the units' order, so an
    asynchronous save still releases the units front to back) of about equal bytes."""
    sizes = [t.numel() * torch.empty((), dtype=t.dtype).element_size() for t in optim.values()]
    total = sum(sizes)
    n = OPTIM_PARTS if total >= OPTIM_PARTS_FROM_BYTES else 1
    if n == 1:
        return [(OPTIM_FILE, dict(optim))]
    runs: list[dict] = [{} for _ in range(n)]
    done = 0
    for (key, t), size in zip(optim.items(), sizes):
        # the run whose share of the bytes this tensor's middle falls in
        runs[min(n - 1, (2 * done + size) * n // (2 * total))][key] = t
        done += size
    runs = [r for r in runs if r]
    return [(f"optimizer-{i + 1:05d}-of-{len(runs):05d}.safetensors", r) for i, r in enumerate(runs)]


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


def finish_checkpoint(engine, tmp: Path, *, step: int, tokenizer, state: dict, state_text: str, dtype: torch.dtype,
                      streamed: dict[str, FileDigest], rng: dict, threads: int | None = None) -> None:
    """The rest of a checkpoint once its tensor files are in `tmp` (`streamed`: their digests taken
    while writing): config, tokenizer, RNG states and state.json, fsync of the tree, manifest,
    COMPLETE marker, fsync of the directory, then `verify_files`."""
    _write_config(engine, tmp, dtype)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    sdir = tmp / STATE_DIR
    sdir.mkdir(exist_ok=True)
    torch.save(rng, sdir / "rng.pt")
    (sdir / "state.json").write_text(state_text)
    _fsync_tree(tmp)
    manifest = _write_manifest(tmp, streamed)
    maybe_corrupt(tmp, step)                # tests only (faults.py): a disk that corrupts a write
    _write_synced(tmp / COMPLETE, json.dumps({"step": step, "time": state["time"],
                                              MANIFEST: manifest.record()}) + "\n")
    _fsync_dir(tmp)
    # Read back from the disk before the rename: a save counts (and an older checkpoint may be
    # pruned) only once what is on the disk is what was written.
    verify_files(tmp, threads=threads)


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


def _write_config(engine, directory: Path, dtype: torch.dtype) -> None:
    cfg = copy.deepcopy(engine.split.config)
    if "quantization_config" in vars(cfg):
        # The masters are plain floating point: a saved copy is not a quantized checkpoint.
        delattr(cfg, "quantization_config")
    cfg.dtype = str(dtype).split(".")[-1]
    model = getattr(engine.split, "model", None)
    if model is not None:
        cfg.architectures = [type(model).__name__]
    gen_params = cfg._get_generation_parameters() if hasattr(cfg, "_get_generation_parameters") else {}
    if gen_params:
        # HF keeps generation defaults out of config.json (save_pretrained refuses them).
        from transformers import GenerationConfig
        GenerationConfig(**gen_params).save_pretrained(str(directory))
        for k in gen_params:
            setattr(cfg, k, None)
    cfg.save_pretrained(str(directory))


def write_weights(params: Iterable[tuple[str, torch.Tensor | StreamedTensor]], directory: Path, dtype: torch.dtype,
                  max_shard_bytes: int, *, pool: ThreadPoolExecutor | None = None,
                  cancel: threading.Event | None = None) -> dict[str, FileDigest]:
    """The (HF name, FP32 tensor) pairs of `params` (engine.named_master_params()'s) shard by shard:
    accumulate views up to max_shard_bytes, cast only the shard being written. Returns each
    shard's digest by its final name."""
    shards: list[list[str]] = []
    digests: list[FileDigest] = []
    total = 0
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    elem = torch.tensor([], dtype=dtype).element_size()

    def flush():
        nonlocal pending, pending_bytes
        if not pending:
            return
        part = directory / f"model-{len(shards) + 1:05d}.partial.safetensors"
        digests.append(save_tensors(pending, part, dtype=dtype, pool=pool, cancel=cancel))
        shards.append(list(pending))
        pending, pending_bytes = {}, 0

    seen = set()
    for name, t in params:
        if name in seen:
            continue                 # a tied weight appears once
        seen.add(name)
        nbytes = t.numel() * elem
        if pending and pending_bytes + nbytes > max_shard_bytes:
            flush()
        pending[name] = t
        pending_bytes += nbytes
        total += nbytes
    flush()
    n = len(shards)
    if n == 1:
        os.replace(directory / "model-00001.partial.safetensors", directory / "model.safetensors")
        return {"model.safetensors": digests[0]}
    weight_map, finals = {}, {}
    for i, names in enumerate(shards, 1):
        final = f"model-{i:05d}-of-{n:05d}.safetensors"
        os.replace(directory / f"model-{i:05d}.partial.safetensors", directory / final)
        weight_map.update({k: final for k in names})
        finals[final] = digests[i - 1]
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    return finals


def save_tensors(tensors: Mapping[str, torch.Tensor], path: Path, dtype: torch.dtype | None = None,
                 **io) -> FileDigest:
    # Looked up at call time (tests replace write_safetensors to simulate a full disk).
    return write_safetensors(tensors, path, dtype=dtype, **io)


def _write_manifest(directory: Path, streamed: dict[str, FileDigest]) -> FileDigest:
    """MANIFEST.json: every file of `directory` with its size and digest (those in `streamed` as
    taken while writing; the others, all small, read once now), written and fsynced; its own digest."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        files[rel] = (streamed.get(rel) or file_digest(path)).record()
    text = json.dumps({"algorithm": DIGEST, "files": files}, indent=1, sort_keys=True) + "\n"
    _write_synced(directory / MANIFEST, text)
    return FileDigest(len(text.encode()), xxhash.xxh3_128(text.encode()).hexdigest())


_READ_BYTES = 64 * 2**20        # one read() of a verification


def file_digest(path: Path) -> FileDigest:
    """The size and digest of a file on disk, read in chunks."""
    h, size = xxhash.xxh3_128(), 0
    buf = bytearray(_READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return FileDigest(size, h.hexdigest())


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(tensors: Mapping[str, torch.Tensor], path: Path, dtype: torch.dtype | None = None,
                      metadata: dict[str, str] | None = None, *, pool: ThreadPoolExecutor | None = None,
                      threads: int | None = None, cancel: threading.Event | None = None) -> FileDigest:
    """A safetensors file written tensor by tensor from where the tensors are (format: a little-
    endian u64 header length, the JSON header padded to 8 bytes, then the tensors' bytes in
    header order), so the file never exists in RAM. `dtype`: each tensor converted as it is
    written (a chunk at a time); a tensor on a GPU comes down through two pinned staging buffers.
    The bytes go out in large pieces written by `pool` (or a pool of `threads`) at their offsets
    while this thread hashes them in order (checkpoint_io.ParallelFile); `cancel` set (another
    stream failed) stops it at its next piece. Readable by safetensors (safe_open, load_file) and
    HF from_pretrained. Returns the file's size and digest, hashed as the bytes are written."""
    entries, offset = [], 0
    for name, t in tensors.items():
        dt = dtype or t.dtype
        if dt not in _ST_DTYPES:
            raise TypeError(f"{name}: dtype {dt} has no safetensors code here")
        n = t.numel() * torch.empty((), dtype=dt).element_size()
        entries.append((name, t, dt, offset, offset + n))
        offset += n
    header = {name: {"dtype": _ST_DTYPES[dt], "shape": list(t.shape), "data_offsets": [lo, hi]}
              for name, t, dt, lo, hi in entries}
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    stager = Stager()
    with io_pool(pool, threads) as io, ParallelFile(path, io, cancel) as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, t, dt, lo, hi in entries:
            for piece in host_pieces(t, dt, stager):
                f.write(piece)
    return f.digest()


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
    _fsync_dir(final.parent)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
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


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory; then drop the files' pages from the page cache (they are
    clean now): the read-back that verifies the save reads the disk, not RAM, and a checkpoint of
    ~100 GB does not evict what the run still uses."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fsync_and_drop(os.path.join(dirpath, name))
        _fsync_dir(Path(dirpath))


def fsync_and_drop(path: str | os.PathLike) -> None:
    """fsync a file, then drop its (now clean) pages from the page cache: the next read of it
    reads the disk (the benchmarks' scripts time cold reads with it too)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


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


def _restore_rng(state: dict) -> None:
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
        weight_map = _read_json(ckpt, index)
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
    state = _read_state(ckpt)
    engine.synchronize()
    masters = _LazyTensors(_weight_files(ckpt))
    # shapes only: the GPU-held masters stay where they are (an 8B on an H200 keeps 89 GiB there)
    want = {name: (tuple(t.shape), None) for name, t in engine.named_master_params(on_host=False)}
    optim = _LazyTensors({k: p for path in optimizer_files(ckpt) for k, p in _file_keys(path).items()})
    want_optim = {key: (tuple(t.shape), _ST_DTYPES.get(t.dtype, str(t.dtype)))
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
    rng = _read_rng(ckpt)

    engine.load_state(masters, optim, int(state["step"]))
    if rng is not None:
        _restore_rng(rng)
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


# The moments' safetensors dtype for each --moments (engine/adamw.py OPTIMIZER_STATES); the 8-bit
# scales and the step are FP32, and so are the moments of units updated on the GPU in any format
MOMENT_DTYPES = {"fp32": "F32", "bf16": "BF16", "8bit": "U8"}


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
    state = _read_state(ckpt)
    if not state.get("with_optimizer", False):
        raise CheckpointError(f"checkpoint {ckpt} cannot be resumed exactly: it was saved without optimizer state "
                              f"(save_dtype={state.get('save_dtype')!r}, with_optimizer={state.get('with_optimizer')})"
                              f". Load it as a model directory (weights only) to start a new run from it")
    optim_files = optimizer_files(ckpt)
    weight_files = sorted(set(_weight_files(ckpt).values()))
    if listed is not None:
        _check_listed(ckpt, listed, [*weight_files, *optim_files])
    config = ckpt / "config.json"
    if not isinstance(_read_json(ckpt, config), dict):
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
    _read_rng(ckpt)
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
    are read at once (checkpoint_io.digests_parallel, `threads` readers). False when there is no
    trace of a manifest (a checkpoint of a slidetune older than it): nothing could be verified."""
    return _verified_files(Path(ckpt_dir), threads) is not None


def _verified_files(ckpt: Path, threads: int | None = None) -> set[str] | None:
    """verify_files' work: the files MANIFEST.json lists (relative paths), each verified, or None for
    a checkpoint with no trace of a manifest. Where COMPLETE records one (this slidetune wrote it),
    a missing MANIFEST.json, or a record that is not {size, digest}, is damage, never "older"."""
    path = ckpt / MANIFEST
    complete = _read_json(ckpt, ckpt / COMPLETE)
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
    manifest = _read_json(ckpt, path)
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
    _fsync_dir(target.parent)
    return target


def _read_json(ckpt: Path, path: Path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointCorrupt(ckpt, path, "missing") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorrupt(ckpt, path, f"not valid JSON ({e})") from None


def _read_state(ckpt: Path) -> dict:
    """trainer_state/state.json, with the type of every field a resume reads checked."""
    path = ckpt / STATE_DIR / "state.json"
    if not path.exists():
        raise CheckpointError(f"checkpoint {ckpt} has no {STATE_DIR}/state.json: it is a model export, "
                              f"not a resumable checkpoint")
    state = _read_json(ckpt, path)
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


def _read_rng(ckpt: Path) -> dict | None:
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
    """What is wrong with a loaded rng.pt (None: it restores as _restore_rng expects)."""
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


# --------------------------------------------------------------------------- run directories
def _is_complete(path: Path) -> bool:
    return path.is_dir() and (path / COMPLETE).exists()


def _complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for p in run_dir.iterdir():
        m = _CKPT_RE.match(p.name)
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
    between its two renames also `<name>.old-<pid>` (module docstring). Those of processes
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
                _fsync_dir(directory)
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
