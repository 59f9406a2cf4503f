"""A model directory and preference pairs for `train --objective dpo` on the GPU machine (issue 47),
which reaches no hub: a preset's shape (default Qwen3-8B) as a HuggingFace directory with random
BF16 weights (safetensors shards and their index, as a Hub snapshot holds them), a byte-level BPE
tokenizer trained on the built-in corpus (32,000 ids, below any preset's vocabulary), and a JSONL
of TRL's standard preference records cut from the same corpus: a prompt of about `--prompt-chars`
characters, the chosen completion its continuation and the rejected one another document's text,
so prompt + completion is about `--seq-len` tokens. Random weights run at the speed of real ones
(the step is the same arithmetic); the losses mean nothing.

    python benchmarks/scripts/preference_model.py OUT_DIR [--model qwen3-8b] [--pairs 160]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

SHARD_BYTES = 4 * 2**30          # the shard size HF's save_pretrained writes by default (5 GB) rounded down


def write_weights(out: Path, model: str, seed: int) -> int:
    """Random BF16 weights of the preset's shape in safetensors shards with their index; returns params."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from slidetune.models.presets import preset_config
    cfg = preset_config(model)
    cfg.save_pretrained(out)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(seed)
    shard, shard_bytes, index, n_params, files = {}, 0, {}, 0, []

    def flush():
        nonlocal shard, shard_bytes
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        files.append(name)
        index.update({k: name for k in shard})
        shard, shard_bytes = {}, 0
    for name, p in meta.state_dict().items():
        if name.endswith("norm.weight") or p.dim() == 1:
            t = torch.ones(p.shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16)
        shard[name] = t
        shard_bytes += t.numel() * 2
        n_params += t.numel()
        if shard_bytes >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    # shard names as save_pretrained writes them: -of- the count
    renamed = {f: f.replace(".safetensors", f"-of-{len(files):05d}.safetensors") for f in files}
    for old, new in renamed.items():
        (out / old).rename(out / new)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 2 * n_params}, "weight_map": {k: renamed[v] for k, v in index.items()}}, indent=1))
    return n_params


def write_tokenizer(out: Path, corpus: list[str]) -> None:
    """A byte-level BPE of 32,000 ids trained on the corpus, EOS and padding <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>",
                            pad_token="<|endoftext|>").save_pretrained(out)


def write_pairs(path: Path, corpus: list[str], n: int, prompt_chars: int, completion_chars: int, seed: int) -> int:
    """n standard preference records cut from the corpus's longer documents (module docstring)."""
    r = random.Random(seed)
    text = "\n\n".join(corpus)
    span = prompt_chars + completion_chars
    with path.open("w") as f:
        for _ in range(n):
            start = r.randrange(0, len(text) - 2 * span)
            other = r.randrange(0, len(text) - 2 * span)
            prompt = text[start:start + prompt_chars]
            f.write(json.dumps({"prompt": prompt, "chosen": text[start + prompt_chars:start + span],
                                "rejected": text[other:other + completion_chars]}) + "\n")
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--pairs", type=int, default=160)
    ap.add_argument("--prompt-chars", type=int, default=2000)
    ap.add_argument("--completion-chars", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    from slidetune.data.corpus import builtin_corpus
    a.out.mkdir(parents=True, exist_ok=True)
    corpus = builtin_corpus()
    t0 = time.perf_counter()
    n = write_weights(a.out / "model", a.model, a.seed)
    t1 = time.perf_counter()
    write_tokenizer(a.out / "model", corpus)
    write_pairs(a.out / "pairs.jsonl", corpus, a.pairs, a.prompt_chars, a.completion_chars, a.seed)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.out / "model")
    lengths = [len(tok(json.loads(line)["prompt"] + json.loads(line)["chosen"])["input_ids"])
               for line in (a.out / "pairs.jsonl").read_text().splitlines()[:20]]
    print(json.dumps({"model": a.model, "params": n, "weights_s": round(t1 - t0, 1), "pairs": a.pairs,
                      "tokens_prompt_plus_chosen_first20": lengths}))


if __name__ == "__main__":
    main()
