"""Where a checkpoint write's time goes, phase by phase (benchmarks/NOTES.md "Checkpoint writer").

A set of FP32 tensors of GIB GiB on the CPU (and as many on the GPU where CUDA exists), shaped
like a model's: layer-sized tensors of LAYER_MIB MiB. Three measurements, each a fresh directory:

1. phases: the serial writer (write_safetensors as it was before the parallel writer: one
   tensor at a time, a pageable `.to("cpu")` of a GPU tensor, `f.write` in 256 MiB pieces,
   the xxh3-128 digest on the same thread), each phase timed on its own: D2H copy, cast (the
   BF16 export), write syscalls, digest, fsync, read-back (pages dropped first).
2. writer: checkpoint.write_safetensors as the library has it now (FP32 from the CPU; BF16
   export; FP32 from the GPU), then the fsync, then the read-back (checkpoint/io.py's
   digests_parallel).
3. save: the resumable save's tensor files, weights (1/3, shards of SHARD_MIB) and moments (2/3,
   in the files checkpoint.optimizer_parts makes of them) as checkpoint.write_tensor_files writes
   them in a blocking save, then its fsync and read-back, against the sum of the serial writer's;
   with --optimizer-parts 1,2 once with the moments in one file and once in two (each stream's
   seconds printed: the one that ends last bound the write).

    python benchmarks/scripts/checkpoint_write.py DIR [--gib 4] [--threads N] [--skip-serial]
        [--gpu-only --stage-mib 64,256]     # the GPU tensors' cases once per staging buffer size
        [--saves-only --optimizer-parts 1,2]  # the resumable save alone, the moments in 1 then 2 files

Run it with PYTHONPATH at another tree's src/ for an A/B: one with the checkpoint package
(src/slidetune/checkpoint/); a tree from before the package has its own copy of this script,
which reads its single checkpoint module (and, before the parallel writer, its serial API).

On tmpfs (/dev/shm) the fsync is free and the page cache cannot be dropped (the read-back reads
memory); on a disk the read-back reads the disk.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import struct
import time
from pathlib import Path

import torch
import xxhash

from slidetune import checkpoint
from slidetune.checkpoint import format as ckpt_format
from slidetune.checkpoint import io as ckpt_io
from slidetune.checkpoint import store as ckpt_store
from slidetune.checkpoint import writer as ckpt_writer

PIECE = 256 * 2**20


def make_tensors(gib: float, layer_mib: int, device: str) -> dict[str, torch.Tensor]:
    n = max(1, int(gib * 1024 / layer_mib))
    numel = layer_mib * 2**20 // 4
    g = torch.Generator().manual_seed(0)
    return {f"layer.{i}.w": torch.randn(numel, generator=g).to(device) for i in range(n)}


def serial_phases(tensors: dict, path: Path, dtype: torch.dtype) -> dict[str, float]:
    """The pre-parallel writer, each phase's seconds summed over the tensors."""
    t = {"d2h": 0.0, "cast": 0.0, "write": 0.0, "digest": 0.0, "fsync": 0.0, "readback": 0.0}
    entries, offset, esz = [], 0, torch.empty((), dtype=dtype).element_size()
    for name, x in tensors.items():
        entries.append((name, x, offset, offset + x.numel() * esz))
        offset += x.numel() * esz
    header = {n: {"dtype": ckpt_format.ST_DTYPES[dtype], "shape": list(x.shape), "data_offsets": [lo, hi]}
              for n, x, lo, hi in entries}
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    h = xxhash.xxh3_128()
    with open(path, "wb") as f:
        for b in (struct.pack("<Q", len(text)), text):
            f.write(b)
            h.update(b)
        for _, x, _, _ in entries:
            src = x.detach()
            if src.device.type != "cpu":
                t0 = time.perf_counter()
                src = src.to("cpu")
                t["d2h"] += time.perf_counter() - t0
            if src.dtype != dtype:
                t0 = time.perf_counter()
                src = src.to(dtype)
                t["cast"] += time.perf_counter() - t0
            raw = src.contiguous().reshape(-1).view(torch.uint8).numpy()
            for start in range(0, raw.size, PIECE):
                piece = memoryview(raw[start:start + PIECE])
                t0 = time.perf_counter()
                f.write(piece)
                t1 = time.perf_counter()
                h.update(piece)
                t["digest"] += time.perf_counter() - t1
                t["write"] += t1 - t0
    t0 = time.perf_counter()
    checkpoint.fsync_and_drop(path)
    t["fsync"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = checkpoint.file_digest(path)              # one file read and hashed on one thread
    t["readback"] = time.perf_counter() - t0
    assert got.digest == h.hexdigest()
    return t


def _threads_kw(threads: int | None) -> dict:
    return {} if threads is None else {"threads": threads}


def library_writer(tensors: dict, path: Path, dtype: torch.dtype, threads: int | None) -> dict[str, float]:
    t0 = time.perf_counter()
    d = checkpoint.write_safetensors(tensors, path, dtype=dtype, **_threads_kw(threads))
    t1 = time.perf_counter()
    checkpoint.fsync_and_drop(path)
    t2 = time.perf_counter()
    got = ckpt_io.digests_parallel([path], threads)[path]
    t3 = time.perf_counter()
    assert got == d
    return {"write+digest": t1 - t0, "fsync": t2 - t1, "readback": t3 - t2}


def library_save(tensors: dict, directory: Path, threads: int | None, shard_mib: int,
                 streams: dict[str, float] | None = None) -> dict[str, float]:
    """A resumable save's tensor files: a third of the tensors as weight shards, the rest as the
    optimizer state (the 8B's 32.8 + 65.5 GB split); `streams` gets each stream's seconds where
    the library records them."""
    names = list(tensors)
    k = max(1, len(names) // 3)
    weights = [(n, tensors[n]) for n in names[:k]]
    optim = {n: tensors[n] for n in names[k:]}
    (directory / checkpoint.STATE_DIR).mkdir(parents=True)
    t0 = time.perf_counter()
    kw = _threads_kw(threads)
    if streams is not None:
        kw["stream_s"] = streams
    digests = checkpoint.write_tensor_files(weights, optim, directory, torch.float32, shard_mib * 2**20, **kw)
    t1 = time.perf_counter()
    ckpt_store.fsync_tree(directory)
    t2 = time.perf_counter()
    paths = [directory / rel for rel in digests]
    got = ckpt_io.digests_parallel(paths, threads)
    t3 = time.perf_counter()
    assert all(got[directory / rel] == d for rel, d in digests.items())
    return {"write+digest": t1 - t0, "fsync": t2 - t1, "readback": t3 - t2}


@contextlib.contextmanager
def optimizer_files_forced(parts: str | None):
    """The optimizer state in one file ("1") or in the library's parts ("2": from 4 GiB, so the
    threshold is lowered to let a small probe split too); None: the library's own choice."""
    if parts is None:
        yield
        return
    saved = ckpt_writer.OPTIM_PARTS_FROM_BYTES       # read by optimizer_parts at each save
    ckpt_writer.OPTIM_PARTS_FROM_BYTES = 2**62 if parts == "1" else 1
    try:
        yield
    finally:
        ckpt_writer.OPTIM_PARTS_FROM_BYTES = saved


def show(what: str, nbytes: int, phases: dict[str, float]) -> None:
    total = sum(phases.values())
    parts = ", ".join(f"{k} {v:.2f} s ({v / total:.0%})" for k, v in phases.items() if v > 0)
    print(f"{what:<34} {nbytes / 2**30:5.1f} GiB  total {total:6.2f} s ({nbytes / total / 1e9:5.2f} GB/s): {parts}",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--layer-mib", type=int, default=256)
    ap.add_argument("--shard-mib", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None, help="the parallel writer's threads (default: its own)")
    ap.add_argument("--skip-serial", action="store_true")
    ap.add_argument("--gpu-only", action="store_true", help="only the GPU tensors' cases")
    ap.add_argument("--stage-mib", default=None,
                    help="comma list: the GPU cases once per checkpoint/io.py's STAGE_BYTES (default: the library's)")
    ap.add_argument("--saves-only", action="store_true", help="only the resumable save's files (case 3)")
    ap.add_argument("--optimizer-parts", default=None,
                    help="comma list of 1 and 2: the save once with the moments in one file (1) and once in "
                         "checkpoint.optimizer_parts' files (2); default: the library's choice")
    a = ap.parse_args()
    print(f"cpus {os.cpu_count()}, torch {torch.__version__}, threads {a.threads}, dir {a.dir}", flush=True)
    cases = [] if a.gpu_only else [("cpu fp32", "cpu", torch.float32), ("cpu fp32 -> bf16", "cpu", torch.bfloat16)]
    if torch.cuda.is_available():
        stages = [int(m) for m in a.stage_mib.split(",")] if a.stage_mib else [None]
        cases += [(f"gpu fp32{f' stage {m} MiB' if m else ''}", "cuda", torch.float32, m) for m in stages]
    cases = [c if len(c) == 4 else (*c, None) for c in cases]
    if a.saves_only:
        cases = [c for c in cases if c[2] == torch.float32]
    work = a.dir / "checkpoint_write_probe"
    try:
        for what, device, dtype, stage_mib in cases:
            if stage_mib is not None:
                ckpt_io.STAGE_BYTES = stage_mib * 2**20      # read by each Stager as it allocates
            tensors = make_tensors(a.gib, a.layer_mib, device)
            nbytes = sum(x.numel() for x in tensors.values()) * torch.empty((), dtype=dtype).element_size()
            for run, fn in (("serial", None if a.skip_serial else serial_phases), ("library", library_writer)):
                if fn is None or a.saves_only:
                    continue
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir(parents=True)
                phases = fn(tensors, work / "x.safetensors", dtype) if run == "serial" else \
                    fn(tensors, work / "x.safetensors", dtype, a.threads)
                show(f"{run} {what}", nbytes, phases)
            if dtype == torch.float32:
                for parts in a.optimizer_parts.split(",") if a.optimizer_parts else [None]:
                    shutil.rmtree(work, ignore_errors=True)
                    streams: dict[str, float] = {}
                    with optimizer_files_forced(parts):
                        phases = library_save(tensors, work, a.threads, a.shard_mib, streams)
                    label = f"save files {what}" + (f" optim in {parts}" if parts else "")
                    show(label, nbytes, phases)
                    if streams:
                        print(" " * 4 + "streams: " + ", ".join(f"{k} {v:.2f} s" for k, v in streams.items()), flush=True)
            del tensors
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
