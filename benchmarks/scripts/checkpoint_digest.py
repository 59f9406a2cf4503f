"""What a checkpoint's digests cost (benchmarks/NOTES.md "Checkpoint digests").

1. The hash alone, in memory: xxh3_128 (the one the checkpoint package uses), xxh3_64, zlib.crc32, over
   1 GiB in the 256 MiB pieces write_safetensors writes.
2. A streamed safetensors file of SIZE GiB (a RAM tensor of 2 GiB written under several names, so
   the file never needs its size in RAM), written by checkpoint.write_safetensors with the digest
   taken as the bytes pass, against the same writer with the digest off; each followed by the
   fsync a save does. Alternated, REPEATS times each.
3. The read-back that verifies a save: checkpoint.file_digest of that file after its pages were
   dropped from the page cache (posix_fadvise DONTNEED after the fsync, as a save does).

    python benchmarks/scripts/checkpoint_digest.py DIR [--gib 16] [--repeats 2]
"""
from __future__ import annotations

import argparse
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import xxhash

from slidetune import checkpoint

PIECE = 256 * 2**20


def hash_rates(gib: int = 1) -> dict[str, float]:
    buf = np.random.default_rng(0).integers(0, 255, gib * 2**30, dtype=np.uint8)
    view = memoryview(buf)

    class Crc:
        def __init__(self):
            self.value = 0

        def update(self, b):
            self.value = zlib.crc32(b, self.value)

    rates = {}
    for name, make in (("xxh3_128", xxhash.xxh3_128), ("xxh3_64", xxhash.xxh3_64), ("zlib.crc32", Crc)):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            h = make()
            for start in range(0, buf.size, PIECE):
                h.update(view[start:start + PIECE])
            best = min(best, time.perf_counter() - t0)
        rates[name] = buf.size / best / 1e9
    return rates


class _NoDigest:
    """write_safetensors' writer with the digest off: the A/B's other arm."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        self.f.write(data)

    def digest(self):
        return None


def timed_write(path: Path, tensors: dict, digest: bool) -> float:
    real = checkpoint._DigestingWriter
    if not digest:
        checkpoint._DigestingWriter = _NoDigest
    try:
        t0 = time.perf_counter()
        checkpoint.write_safetensors(tensors, path)
        checkpoint.fsync_and_drop(path)
        return time.perf_counter() - t0
    finally:
        checkpoint._DigestingWriter = real


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--gib", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    for name, rate in hash_rates().items():
        print(f"hash in memory  {name:>10}: {rate:6.2f} GB/s (one core)")
    block = torch.randn(2**29)                       # 2 GiB of FP32
    tensors = {f"t{i}": block for i in range(a.gib // 2)}
    path = a.dir / "digest_probe.safetensors"
    size = None
    times = {True: [], False: []}
    try:
        for _ in range(a.repeats):
            for digest in (True, False):
                times[digest].append(timed_write(path, tensors, digest))
                size = path.stat().st_size
        for digest, ts in times.items():
            print(f"write + fsync {size / 2**30:.1f} GiB, digest {'on ' if digest else 'off'}: "
                  + ", ".join(f"{t:.1f} s ({size / t / 1e9:.2f} GB/s)" for t in ts))
        t0 = time.perf_counter()
        checkpoint.file_digest(path)
        t = time.perf_counter() - t0
        print(f"read-back digest (page cache dropped): {t:.1f} s ({size / t / 1e9:.2f} GB/s)")
    finally:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
