"""The rate of the token-id check a pre-tokenized corpus gets when it is opened (token_arrays.py).

Writes a synthetic uint32 .bin corpus of --tokens token ids (4 bytes each) into a temporary
directory, through np.memmap windows of 64 MiB (no corpus-sized buffer), then runs
`TokenStream.check_ids` over it as `build_datasets` does: once cold (the file's pages dropped
from the page cache with posix_fadvise after an fsync, so the disk is read) and once warm (the
pages cached), sampling the process's RSS meanwhile. Deletes the file.

Usage: python benchmarks/scripts/token_id_check.py OUT.json [--tokens 1000000000] [--dir /tmp]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time

import numpy as np
import psutil

from slidetune.checkpoint import fsync_and_drop
from slidetune.data.token_arrays import open_token_stream
from slidetune.telemetry.machine import machine_info

VOCAB = 151936                  # Qwen3's vocabulary: ids above 65535, so a uint32 file
BLOCK_TOKENS = 2**24            # written 64 MiB at a time


def write_corpus(path: str, n_tokens: int) -> float:
    """A uint32 .bin of n_tokens random ids < VOCAB; one random block, shifted per block. Seconds taken."""
    t0 = time.perf_counter()
    block = np.random.default_rng(0).integers(0, VOCAB, BLOCK_TOKENS, dtype=np.uint32)
    with open(path, "wb") as f:
        f.truncate(n_tokens * 4)
    for k, lo in enumerate(range(0, n_tokens, BLOCK_TOKENS)):
        n = min(BLOCK_TOKENS, n_tokens - lo)
        window = np.memmap(path, dtype=np.uint32, mode="r+", offset=lo * 4, shape=(n,))
        np.add(block[:n], k, out=window)
        np.remainder(window, VOCAB, out=window)
        window.flush()
        del window
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def timed_check(path: str) -> dict:
    """check_ids over the file, with the process's peak RSS above its start (sampled every 10 ms)."""
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak, done = [base], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.01)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    stream = open_token_stream(path, "uint32")
    stream.check_ids(VOCAB)
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    size = os.path.getsize(path)
    return {"seconds": round(seconds, 3), "gb_per_s": round(size / seconds / 1e9, 3),
            "s_per_1b_tokens": round(seconds * 1e9 / len(stream), 3),
            "rss_growth_mib": round((peak[0] - base) / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=1_000_000_000)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    need = args.tokens * 4
    free = shutil.disk_usage(args.dir).free
    if free < need + 2**30:
        raise SystemExit(f"{args.dir}: {free / 1e9:.1f} GB free, the corpus needs {need / 1e9:.1f} GB and 1 GB to spare")
    d = tempfile.mkdtemp(prefix="token_id_check_", dir=args.dir)
    path = os.path.join(d, "corpus.bin")
    try:
        result = {"tokens": args.tokens, "bytes": need, "vocab_size": VOCAB, "dir": args.dir,
                  "write_s": round(write_corpus(path, args.tokens), 1)}
        fsync_and_drop(path)
        result["cold"] = timed_check(path)
        result["warm"] = timed_check(path)
        result["machine"] = machine_info()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))


if __name__ == "__main__":
    main()
