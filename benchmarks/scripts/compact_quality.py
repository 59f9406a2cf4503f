"""What the compact host state costs in quality on a real fine-tune (issue 46): the embedded
SmolLM2-135M trained with `slidetune train` on the built-in corpus and on a chat set, once per state
format (FP32, the reference, and each compact combination), with the held-out loss taken every
`--eval-every` steps. Writes, under --out:

  <dataset>/<format>/      each run's output directory (metrics.csv, summary.json, config.json)
  quality.json             per dataset and format: the held-out loss curve, the final loss and
                           perplexity, and their differences from FP32's
  quality.png              the held-out loss curves, one panel a dataset, the final perplexities
                           in the legend
  chat.jsonl               the chat set (below), as trained on

The chat set is made here, nothing downloaded: each standard-library docstring of the built-in
corpus (data/corpus.py) becomes a conversation, the user asking what the object does and the
assistant answering with its docstring; trained with the assistant's tokens alone in the loss
(`--chat-template qwen3`: ChatML, whose <|im_start|>/<|im_end|> tokens SmolLM2's tokenizer has).

Every run uses the same seed, data order and schedule; only the state format differs. Runs go
`--parallel` at a time (a 135M model leaves the GPU and the host's cores room for several), each
with its share of the host's cores for its AdamW (--tuning.host_threads).

    python benchmarks/scripts/compact_quality.py --out /tmp/quality --steps 500 --parallel 4
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# name -> the flags of one state format (engine/adamw.py OPTIMIZER_STATES); fp32 is the reference
FORMATS = {"fp32": [], "bf16-moments": ["--moments", "bf16"], "8bit-moments": ["--moments", "8bit"],
           "bf16-master-8bit-moments": ["--master", "bf16", "--moments", "8bit"]}
DATASETS = ("corpus", "chat")


def chat_set(path: Path) -> int:
    """The chat set: one conversation per standard-library docstring of the built-in corpus, in its
    sorted order. Returns the number of conversations."""
    from slidetune.data.corpus import stdlib_docstrings
    n = 0
    with path.open("w") as f:
        for name, doc in sorted(stdlib_docstrings().items()):
            module, _, qualname = name.partition(":")
            what = f"`{module}.{qualname}`" if qualname else f"the `{module}` module"
            messages = [{"role": "user", "content": f"What does {what} in Python's standard library do?"},
                        {"role": "assistant", "content": doc.strip()}]
            f.write(json.dumps({"messages": messages}) + "\n")
            n += 1
    return n


def run_one(out: Path, dataset: str, fmt: str, args, chat: Path, threads: int) -> dict:
    """One `slidetune train` run; returns its held-out curve and wall time (or its failure)."""
    run_dir = out / dataset / fmt
    data = ["--data", str(chat), "--chat-template", "qwen3"] if dataset == "chat" else []
    cmd = [sys.executable, "-m", "slidetune.cli", "train", "--output-dir", str(run_dir), "--max-steps", str(args.steps),
           "--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches), "--progress", "false",
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--lr", str(args.lr),
           "--tuning.host_threads", str(threads), *data, *FORMATS[fmt], *args.extra]
    t0 = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True)
    (out / dataset).mkdir(parents=True, exist_ok=True)
    (out / dataset / f"{fmt}.log").write_text(done.stdout + done.stderr)
    rec = {"dataset": dataset, "format": fmt, "flags": FORMATS[fmt], "command": " ".join(cmd[1:]),
           "wall_s": round(time.time() - t0, 1), "returncode": done.returncode}
    if done.returncode != 0:
        rec["error"] = (done.stderr or done.stdout)[-2000:]
        return rec
    with (run_dir / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    rec["eval"] = [(int(r["step"]), float(r["eval_loss"])) for r in rows if r.get("eval_loss")]
    rec["train_loss_last"] = next(float(r["loss"]) for r in reversed(rows) if r.get("loss"))
    rec["final_eval_loss"] = rec["eval"][-1][1]
    rec["final_ppl"] = math.exp(rec["final_eval_loss"])
    return rec


def compare(records: list[dict]) -> dict:
    """Per dataset and format: the final loss and perplexity, and their differences from FP32's."""
    out: dict = {}
    for r in records:
        out.setdefault(r["dataset"], {})[r["format"]] = r
    for runs in out.values():
        ref = runs.get("fp32")
        for r in runs.values():
            if ref and "final_eval_loss" in r and "final_eval_loss" in ref:
                r["eval_loss_minus_fp32"] = r["final_eval_loss"] - ref["final_eval_loss"]
                r["ppl_ratio_to_fp32"] = r["final_ppl"] / ref["final_ppl"]
                # the largest gap along the curve, at the same steps
                gaps = [a[1] - b[1] for a, b in zip(r["eval"], ref["eval"]) if a[0] == b[0]]
                r["max_curve_gap"] = max(gaps, key=abs) if gaps else None
    return out


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, (dataset, runs) in zip(axes[0], results.items()):
        for fmt, r in runs.items():
            if "eval" not in r:
                continue
            steps, losses = zip(*r["eval"])
            ax.plot(steps, losses, marker=".", label=f"{fmt}: ppl {r['final_ppl']:.3f}",
                    linestyle="-" if fmt == "fp32" else "--")
        ax.set_title(f"{dataset}")
        ax.set_xlabel("step")
        ax.set_ylabel("held-out loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma list of " + ", ".join(FORMATS))
    ap.add_argument("--datasets", default=",".join(DATASETS))
    ap.add_argument("--parallel", type=int, default=4, help="runs at once")
    ap.add_argument("extra", nargs="*", help="more `slidetune train` flags, after --")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    chat = args.out / "chat.jsonl"
    n_chat = chat_set(chat)
    formats = [f for f in args.formats.split(",") if f]
    jobs = [(d, f) for d in args.datasets.split(",") if d for f in formats]
    threads = max(1, (os.cpu_count() or 2) // max(1, min(args.parallel, len(jobs))))
    with ThreadPoolExecutor(args.parallel) as pool:
        records = list(pool.map(lambda job: run_one(args.out, *job, args, chat, threads), jobs))
    results = compare(records)
    summary = {"date": time.strftime("%Y-%m-%d"), "steps": args.steps, "eval_every": args.eval_every,
               "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr, "chat_conversations": n_chat,
               "host_threads_each": threads, "results": results}
    (args.out / "quality.json").write_text(json.dumps(summary, indent=1))
    plot(results, args.out / "quality.png",
         f"SmolLM2-135M, {args.steps} steps of {args.batch_size} x {args.seq_len}, lr {args.lr:g}, clip 1.0: "
         f"held-out loss by host state format")
    for dataset, runs in results.items():
        for fmt, r in runs.items():
            print(f"{dataset:7s} {fmt:26s} " + (f"final loss {r['final_eval_loss']:.4f} ppl {r['final_ppl']:.3f}"
                                                 f" ({r.get('eval_loss_minus_fp32', 0):+.4f} vs fp32) {r['wall_s']} s"
                                                 if "final_eval_loss" in r else f"FAILED: {r.get('error', '')[-300:]}"))
    return 0 if all(r.get("returncode") == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
