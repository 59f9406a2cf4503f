"""Do parallel writes into one file scale, or only across files? (benchmarks/NOTES.md "Checkpoint writer")

    python benchmarks/scripts/write_scaling.py DIR [--gib 4] [--threads 8]

GIB GiB written as 32 MiB `os.pwrite` slices by THREADS threads: (a) all into one file at their
offsets, (b) into THREADS files, one each, (c) by one thread into one file. Fresh files each
time; on a disk the fsync is timed apart. Linux takes a file's inode lock for each buffered write
(ext4, xfs and tmpfs alike), so (a) is expected to run at (c)'s rate and only (b) to scale.
"""
from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SLICE = 32 * 2**20


def write(paths: list[Path], slices_per_file: int, threads: int, buf: memoryview) -> tuple[float, float]:
    fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for p in paths]
    jobs = [(fd, k * SLICE) for fd in fds for k in range(slices_per_file)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda j: os.pwrite(j[0], buf, j[1]), jobs))
    t1 = time.perf_counter()
    for fd in fds:
        os.fsync(fd)
        os.close(fd)
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--threads", type=int, default=8)
    a = ap.parse_args()
    buf = memoryview(os.urandom(SLICE))
    total = int(a.gib * 2**30) // SLICE
    work = a.dir / "write_scaling_probe"
    work.mkdir(parents=True, exist_ok=True)
    cases = [("one file, 1 thread", 1, 1), (f"one file, {a.threads} threads", 1, a.threads),
             (f"{a.threads} files, {a.threads} threads", a.threads, a.threads)]
    try:
        for _round in range(2):
            for what, files, threads in cases:
                for p in work.iterdir():
                    p.unlink()
                paths = [work / f"f{i}" for i in range(files)]
                w, s = write(paths, total // files, threads, buf)
                gb = total // files * files * SLICE / 1e9
                print(f"{what:<24} {gb:5.1f} GB  write {w:6.2f} s ({gb / w:5.2f} GB/s)  fsync {s:5.2f} s", flush=True)
    finally:
        for p in work.iterdir():
            p.unlink()
        work.rmdir()


if __name__ == "__main__":
    main()
