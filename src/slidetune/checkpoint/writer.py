"""Writing a checkpoint: save_checkpoint, and the pieces an asynchronous save (background.py)
shares with it.

The tensor files go out as streams written at once (write_tensor_files: the weight shards, and the
optimizer state in one file or optimizer_parts), each a safetensors file streamed tensor by tensor
(write_safetensors; the bytes through io.py); then finish_checkpoint writes the config, tokenizer,
RNG states and state.json, fsyncs the tree, writes MANIFEST.json and COMPLETE, and reads the whole
directory back (reader.verify_files) before store.save_atomically renames it into place."""
from __future__ import annotations

import copy
import itertools
import json
import os
import struct
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import xxhash

from ..engine.slide.disk_tier import StreamedTensor
from ..faults import maybe_corrupt, maybe_fail
from .export import ModelExport, write_export_files
from .format import (COMPLETE, DIGEST, MANIFEST, OPTIM_FILE, SAVE_DTYPES, ST_DTYPES, STATE_DIR, rng_state,
                     state_record)
from .io import FileDigest, ParallelFile, Stager, host_pieces, io_pool, run_streams
from .reader import verify_files
from .store import fresh_dir, fsync_dir, fsync_tree, save_atomically, write_synced

# Buffered writes into one file run one at a time (the file's inode lock): 8 threads into one file
# wrote at one thread's rate, into 8 files 1.3x (tmpfs) to 1.6x (ext4's page cache) faster
# (benchmarks/NOTES.md "Checkpoint writer"). AdamW's moments are twice the weights, so the optimizer
# state of a large checkpoint goes out as two files beside the weights' stream: three streams of
# equal bytes instead of one file of two thirds of them. A small one stays one file.
OPTIM_PARTS = 2
OPTIM_PARTS_FROM_BYTES = 4 * 2**30


def save_checkpoint(engine, out_dir: Path, *, step: int, tokenizer=None, trainer_state: dict | None = None,
                    save_dtype: str = "fp32", with_optimizer: bool = True,
                    max_shard_bytes: int = 5 * 2**30, writer_threads: int | None = None,
                    stream_s: dict[str, float] | None = None, export: ModelExport | None = None) -> Path:
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
    writer_threads: the writer's and the read-back's I/O threads (None: io.default_threads()).
    stream_s: filled with each tensor stream's seconds (write_tensor_files), where given.
    export: a model repository's directory instead (export.py: no trainer state, the source's
      generation config, the run's chat template, a model card; no optimizer state).
    """
    if save_dtype not in SAVE_DTYPES:
        raise ValueError(f"save_dtype must be one of {sorted(SAVE_DTYPES)}, not {save_dtype!r}")
    if max_shard_bytes <= 0:
        raise ValueError("max_shard_bytes must be positive")
    if save_dtype != "fp32" or export is not None:
        with_optimizer = False
    state, state_text = state_record(engine, step, save_dtype=save_dtype, with_optimizer=with_optimizer,
                                     trainer_state=trainer_state)
    dtype = SAVE_DTYPES[save_dtype]

    def write(tmp: Path) -> None:
        _write_complete(engine, tmp, step=int(step), tokenizer=tokenizer, state=state, state_text=state_text,
                        dtype=dtype, with_optimizer=with_optimizer, max_shard_bytes=max_shard_bytes,
                        threads=writer_threads, stream_s=stream_s, export=export)
    return save_atomically(Path(out_dir), write)


def _write_complete(engine, tmp: Path, *, step: int, tokenizer, state: dict, state_text: str,
                    dtype: torch.dtype, with_optimizer: bool, max_shard_bytes: int, threads: int | None,
                    stream_s: dict[str, float] | None = None, export: ModelExport | None = None) -> None:
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
    buffers = dict(engine.named_buffers())
    tensors, own = itertools.chain(weights, buffers.items()), frozenset(buffers)
    if export is not None:
        tensors, own = _hub_layout(engine, tensors, own)
    streamed = write_tensor_files(tensors, optim, tmp, dtype, max_shard_bytes,
                                  threads=threads, step=step, stream_s=stream_s, own_dtype=own)
    finish_checkpoint(engine, tmp, step=step, tokenizer=tokenizer, state=state, state_text=state_text, dtype=dtype,
                      streamed=streamed, rng=rng_state(), threads=threads, export=export)


def _hub_layout(engine, tensors, own: frozenset[str]):
    """A model repository's tensors under the names transformers' save_pretrained writes (the
    Hub's: MoE experts one tensor each, renamed routers), so that `final/` has the layout its
    source had and tools reading the Hub's names (not transformers 5's fused ones) read it;
    from_pretrained loads either. A checkpoint to resume from keeps the engine's own names."""
    split = engine.split           # Engine.split: None for an engine that sets none
    if split is None:
        return tensors, own
    from ..models.hub_layout import hub_names, to_hub_layout
    names = hub_names(split.model)
    return to_hub_layout(tensors, names), frozenset(names.name(b) for b in own)


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
                       cancel: threading.Event | None = None, stream_s: dict[str, float] | None = None,
                       own_dtype: frozenset[str] = frozenset()) -> dict[str, FileDigest]:
    """A checkpoint's tensor files as streams written at once, sharing one pool of `threads`
    writers: the weight shards (write_weights, one after another) here, and each of the optimizer
    state's files (`optim` in optimizer_parts, into STATE_DIR, which exists) in a thread of its
    own. A failure of any stops the others at their next piece and is raised once all have ended.
    Their digests by path relative to `directory`; `stream_s` (where given) gets each stream's
    seconds from the start to its last byte ("weights", and each optimizer file's name): the one
    that ends last is what bound the write. `own_dtype`: weights written in their own dtype, not
    `dtype` (the constant buffers: FP32 as the source keeps them, in a BF16 export too)."""
    cancel = cancel or threading.Event()
    parts = optimizer_parts(optim) if optim is not None else []
    times = stream_s if stream_s is not None else {}
    t0 = time.monotonic()
    with io_pool(None, threads) as pool:
        def weights_stream() -> dict[str, FileDigest]:
            out = write_weights(weights, directory, dtype, max_shard_bytes, pool=pool, cancel=cancel,
                                own_dtype=own_dtype)
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


def finish_checkpoint(engine, tmp: Path, *, step: int, tokenizer, state: dict, state_text: str, dtype: torch.dtype,
                      streamed: dict[str, FileDigest], rng: dict, threads: int | None = None,
                      export: ModelExport | None = None) -> None:
    """The rest of a checkpoint once its tensor files are in `tmp` (`streamed`: their digests taken
    while writing): config, tokenizer, RNG states and state.json (an export: its files instead,
    export.py), fsync of the tree, manifest, COMPLETE marker, fsync of the directory, then
    `verify_files`."""
    _write_config(engine, tmp, dtype)
    if export is not None:
        write_export_files(tmp, export, tokenizer)
    else:
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        sdir = tmp / STATE_DIR
        sdir.mkdir(exist_ok=True)
        torch.save(rng, sdir / "rng.pt")
        (sdir / "state.json").write_text(state_text)
    fsync_tree(tmp)
    manifest = _write_manifest(tmp, streamed)
    maybe_corrupt(tmp, step)                # tests only (faults.py): a disk that corrupts a write
    write_synced(tmp / COMPLETE, json.dumps({"step": step, "time": state["time"],
                                             MANIFEST: manifest.record()}) + "\n")
    fsync_dir(tmp)
    # Read back from the disk before the rename: a save counts (and an older checkpoint may be
    # pruned) only once what is on the disk is what was written.
    verify_files(tmp, threads=threads)


def _write_config(engine, directory: Path, dtype: torch.dtype) -> None:
    cfg = copy.deepcopy(engine.split.config)
    if "quantization_config" in vars(cfg):
        # The masters are plain floating point: a saved copy is not a quantized checkpoint.
        delattr(cfg, "quantization_config")
    # slidetune's permission to read a heterogeneous config's global fields (units.SplitModel), not the model's
    vars(cfg).pop("allow_global_per_layer_attribute_access", None)
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
                  cancel: threading.Event | None = None,
                  own_dtype: frozenset[str] = frozenset()) -> dict[str, FileDigest]:
    """The (HF name, FP32 tensor) pairs of `params` (engine.named_master_params()'s, then the
    constant buffers) shard by shard: accumulate views up to max_shard_bytes, cast only the shard
    being written (to `dtype`, but the names in `own_dtype`). Returns each shard's digest by its
    final name."""
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
        digests.append(save_tensors(pending, part, dtype=dtype, pool=pool, cancel=cancel,
                                    own_dtype=own_dtype & pending.keys()))
        shards.append(list(pending))
        pending, pending_bytes = {}, 0

    seen = set()
    for name, t in params:
        if name in seen:
            continue                 # a tied weight appears once
        seen.add(name)
        nbytes = t.numel() * (t.element_size() if name in own_dtype else elem)
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


def write_safetensors(tensors: Mapping[str, torch.Tensor], path: Path, dtype: torch.dtype | None = None,
                      metadata: dict[str, str] | None = None, *, pool: ThreadPoolExecutor | None = None,
                      threads: int | None = None, cancel: threading.Event | None = None,
                      own_dtype: Collection[str] = ()) -> FileDigest:
    """A safetensors file written tensor by tensor from where the tensors are (format: a little-
    endian u64 header length, the JSON header padded to 8 bytes, then the tensors' bytes in
    header order), so the file never exists in RAM. `dtype`: each tensor converted as it is
    written (a chunk at a time); a tensor on a GPU comes down through two pinned staging buffers.
    The bytes go out in large pieces written by `pool` (or a pool of `threads`) at their offsets
    while this thread hashes them in order (io.ParallelFile); `cancel` set (another
    stream failed) stops it at its next piece. Readable by safetensors (safe_open, load_file) and
    HF from_pretrained. Returns the file's size and digest, hashed as the bytes are written.
    `own_dtype`: tensors written in their own dtype whatever `dtype` says."""
    entries, offset = [], 0
    for name, t in tensors.items():
        dt = t.dtype if name in own_dtype else (dtype or t.dtype)
        if dt not in ST_DTYPES:
            raise TypeError(f"{name}: dtype {dt} has no safetensors code here")
        n = t.numel() * torch.empty((), dtype=dt).element_size()
        entries.append((name, t, dt, offset, offset + n))
        offset += n
    header = {name: {"dtype": ST_DTYPES[dt], "shape": list(t.shape), "data_offsets": [lo, hi]}
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


def _write_manifest(directory: Path, streamed: dict[str, FileDigest]) -> FileDigest:
    """MANIFEST.json: every file of `directory` with its size and digest (those in `streamed` as
    taken while writing; the others, all small, read once now), written and fsynced; its own digest."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        files[rel] = (streamed.get(rel) or file_digest(path)).record()
    text = json.dumps({"algorithm": DIGEST, "files": files}, indent=1, sort_keys=True) + "\n"
    write_synced(directory / MANIFEST, text)
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
