"""A large pre-tokenized corpus trains without growing host RSS, and resume lands on the same batch.

Writes a synthetic uint16 .bin corpus of --gb GB (nanoGPT's layout: token ids back to back,
EOS between documents) into a temporary directory, opens it as the trainer does
(`build_datasets` -> memory-mapped `TokenArrayDataset`, `BatchSampler`), then draws --batches
shuffled batches (packing "masked": position ids and label cuts at every EOS) and trains a
tiny Llama on each (forward, backward, AdamW; it sees ids modulo its 1024 vocabulary), reading
host RSS (and its anonymous / file-backed parts) before and after. Resume: a fresh process
opens the same file and draws batch k (k in the middle of the run and in a later epoch); its
tokens must equal this process's batch k.

Targets (issue 20): RSS growth < 1 GB over the run; resume on the same batch.
The corpus is written in 64 MB blocks (one random block, shifted per block so rows differ):
writing 5 GB takes about a minute, not the random generation of 2.5 G tokens.
When the disk lacks room for the corpus and 1 GB to spare, --gb is cut to fit, and the JSON
says so (``gb_requested`` / ``gb_written``).

Usage: python benchmarks/scripts/large_corpus_check.py OUT.json [--gb 5] [--batches 300]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types

import numpy as np
import psutil
import torch

from slidetune.data import BatchSampler, DataConfig, build_datasets
from slidetune.telemetry.machine import machine_info

EOS = 0
VOCAB = 65536               # uint16 ids
MODEL_VOCAB = 1024          # the tiny model sees ids % 1024: [B, S, 65536] logits would put
                            # ~2 GB of compute memory into the RSS this check is about
BLOCK_TOKENS = 32 * 2**20   # 64 MB of uint16 per write


def rss() -> dict:
    """Host memory of this process, bytes: rss, and its anonymous / file-backed parts (Linux)."""
    out = {"rss": psutil.Process().memory_info().rss}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:")):
                    key, kb = line.split()[:2]
                    out[key[:-1].lower()] = int(kb) * 1024
    except OSError:
        pass
    return out


def write_corpus(path: str, n_bytes: int, seed: int = 0) -> int:
    """A uint16 token file of about n_bytes: documents of ~1000 tokens ending with EOS."""
    rng = np.random.default_rng(seed)
    block = rng.integers(1, VOCAB, BLOCK_TOKENS, dtype=np.uint16)
    block[rng.integers(0, BLOCK_TOKENS, BLOCK_TOKENS // 1000)] = EOS
    written = 0
    with open(path, "wb") as f:
        k = 0
        while written < n_bytes:
            n = min(BLOCK_TOKENS, (n_bytes - written) // 2)
            tokens = block[:n] + np.uint16(k)                 # differ per block (wraps at 65536)
            tokens[tokens == EOS] = 1
            tokens[block[:n] == EOS] = EOS                    # the same documents
            f.write(tokens.tobytes())
            written += n * 2
            k += 1
    return written


def tiny_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


BATCH_IN_NEW_PROCESS = """
import json, sys, types
from slidetune.data import BatchSampler, DataConfig, build_datasets
path, seq, bs, seed, index = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
train, _ = build_datasets(DataConfig(path=path, seq_len=seq), types.SimpleNamespace(eos_token_id=0))
print(json.dumps(BatchSampler(train, bs, seed, pad_id=0).batch(index).input_ids.tolist()))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("--gb", type=float, default=5.0, help="corpus size in GB (1e9 bytes)")
    ap.add_argument("--dir", default=None, help="where to write the corpus (default: a temp dir, removed after)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="large_corpus_", dir=args.dir)
    free = shutil.disk_usage(work).free
    want = int(args.gb * 1e9)
    n_bytes = min(want, max(0, free - 2**30))                 # keep 1 GiB of the disk free
    result: dict = {"machine": machine_info(), "gb_requested": args.gb, "disk_free_bytes": free,
                    "seq_len": args.seq_len, "batch_size": args.batch_size, "batches": args.batches}
    if n_bytes < want:
        print(f"note: {work} has {free / 1e9:.1f} GB free: writing {n_bytes / 1e9:.2f} GB instead of {args.gb} GB")
    try:
        path = os.path.join(work, "train.bin")
        t0 = time.perf_counter()
        result["bytes_written"] = write_corpus(path, n_bytes, args.seed)
        result["gb_written"] = round(result["bytes_written"] / 1e9, 3)
        result["write_s"] = round(time.perf_counter() - t0, 1)

        model = tiny_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        result["rss_before_data"] = rss()
        t0 = time.perf_counter()
        train, heldout = build_datasets(DataConfig(path=path, seq_len=args.seq_len),
                                        types.SimpleNamespace(eos_token_id=EOS))
        sampler = BatchSampler(train, args.batch_size, args.seed, pad_id=0)
        result.update(open_s=round(time.perf_counter() - t0, 3), train_rows=len(train),
                      heldout_rows=len(heldout), batches_per_epoch=len(sampler))
        result["rss_after_open"] = rss()
        first_ids = {}
        peak = 0
        t0 = time.perf_counter()
        for k in range(args.batches):
            batch = sampler.batch(k)
            if k in (0, args.batches // 2):
                first_ids[k] = batch.input_ids.tolist()
            labels = torch.where(batch.labels >= 0, batch.labels % MODEL_VOCAB, batch.labels)
            out = model(input_ids=batch.input_ids % MODEL_VOCAB, position_ids=batch.position_ids, use_cache=False)
            loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            peak = max(peak, rss()["rss"])
        result["train_s"] = round(time.perf_counter() - t0, 1)
        result["rss_after_batches"] = rss()
        result["rss_peak"] = peak
        growth = peak - result["rss_before_data"]["rss"]
        result["rss_growth_bytes"] = growth
        result["rss_growth_ok"] = growth < 1e9

        # resume: a new process, as a resumed run, draws the same batches by index
        later = args.batches // 2 + 3 * len(sampler)           # the same position, three epochs on
        checks = {}
        for k, want_ids in list(first_ids.items()) + [(later, sampler.batch(later).input_ids.tolist())]:
            got = subprocess.run([sys.executable, "-c", BATCH_IN_NEW_PROCESS, path, str(args.seq_len),
                                  str(args.batch_size), str(args.seed), str(k)],
                                 capture_output=True, text=True, check=True).stdout
            checks[str(k)] = json.loads(got) == want_ids
        result["resume_batches_equal"] = checks
        result["resume_ok"] = all(checks.values())
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"corpus {result['gb_written']} GB ({result['train_rows']} train rows of {args.seq_len + 1} tokens), "
          f"{args.batches} batches trained in {result['train_s']} s")
    print(f"host RSS growth {growth / 2**20:.0f} MiB (target < 1 GB): {'ok' if result['rss_growth_ok'] else 'FAIL'}; "
          f"resume on the same batch: {'ok' if result['resume_ok'] else 'FAIL'}")


if __name__ == "__main__":
    main()
