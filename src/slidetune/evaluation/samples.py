"""Greedy samples at each evaluation: what the model says to a few prompts as it trains.

The prompts come from --eval-prompts FILE (a .jsonl of {"prompt": ...} or {"messages": [...]}
records, or a .txt of one prompt per line); without it, chat data gives the first few held-out
conversations (their messages up to the last assistant turn, rendered with the chat template and
add_generation_prompt=True), and other data none. Each evaluation decodes every prompt greedily
with the current weights (`greedy_completions`) and the trainer writes
`<output_dir>/eval_samples.jsonl` (one {"step", "prompt", "completion"} line each, appended) and
logs the text to the trackers.

Decoding is a full forward of the growing rows per new token, without a KV cache: the engines
train and keep no cache, and a few short samples do not need one. Its cost is max_new_tokens
forwards of [rows, width] per batch of prompts: rows = min(batch_size, prompts), width = the longest
prompt plus max_new_tokens rounded up to 64 (at most seq_len). The rows are right-padded to that one
width at every evaluation, so a compiled layer (dynamic=False) compiles one more shape, once. A slide
run streams every layer for each forward: 64 forwards cost about 64 forwards' weight traffic.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..data.chat_template import effective_template, load_chat_template
from ..data.config import DataConfig
from ..data.errors import DataError
from ..data.formats import Example, Source, parse_record
from ..data.mixture import MixedSource
from ..data.hf_datasets import StreamingSource
from ..data.split import plan_heldout
from ..data.tokenization import _render

DEFAULT_CHAT_PROMPTS = 3        # held-out conversations sampled when --eval-prompts is not given
WIDTH_STEP = 64                 # sample rows are padded to a multiple of this (one shape, few padded tokens)


@dataclass(frozen=True)
class EvalPrompt:
    text: str                   # the prompt as the model reads it (a chat one rendered by the template)
    where: str                  # file:line, for messages


def read_prompt_file(path: str, tokenizer: Any, chat_template: str | None) -> list[EvalPrompt]:
    """--eval-prompts FILE: a .jsonl of {"prompt"} or {"messages"} records, or a .txt with one
    prompt per line (blank lines skipped). Raises DataError naming the file and line."""
    file = Path(path)
    if not file.is_file():
        raise DataError(f"--eval-prompts {path}: no such file")
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"--eval-prompts {path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    prompts: list[EvalPrompt] = []
    is_jsonl = file.suffix.lower() in (".jsonl", ".ndjson")
    for lineno, line in enumerate(lines, start=1):
        where = f"{path}:{lineno}"
        if not line.strip():
            continue
        if not is_jsonl:
            prompts.append(EvalPrompt(line, where))
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: malformed JSON: {e.msg} (column {e.colno})") from None
        if isinstance(record, dict) and "messages" not in record and isinstance(record.get("prompt"), str):
            prompts.append(EvalPrompt(record["prompt"], where))
        elif isinstance(record, dict) and "messages" in record:
            prompts.append(chat_prompt(parse_record(record, where), tokenizer, chat_template))
        else:
            raise DataError(f"{where}: an eval prompt is {{\"prompt\": \"...\"}} or {{\"messages\": [...]}}")
    if not prompts:
        raise DataError(f"--eval-prompts {path}: no prompts found (the file is empty)")
    return prompts


def chat_prompt(example: Example, tokenizer: Any, chat_template: str | None) -> EvalPrompt:
    """A conversation's messages up to its last assistant turn (all of them when it has none),
    rendered with the chat template and the generation prompt: what the model answers next."""
    messages = list(example.messages or [])
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=len(messages))
    messages = messages[:last]
    if not messages:
        raise DataError(f"{example.where}: the conversation starts with the assistant: no prompt before it")
    template = effective_template(tokenizer, chat_template, example.tools)
    if template is None:
        raise DataError(f"{example.where}: a chat prompt needs a tokenizer with a chat template, and this one "
                        f"has none; pass --chat-template FILE|NAME")
    text = _render(tokenizer, messages, True, example.where, chat_template=template, tools=example.tools)
    return EvalPrompt(text, example.where)


def heldout_chat_prompts(source: Source | StreamingSource, cfg: DataConfig, tokenizer: Any,
                         n: int = DEFAULT_CHAT_PROMPTS) -> list[EvalPrompt]:
    """The first `n` held-out conversations' prompts (of --eval-data where given), in the order
    build_datasets holds them out; none for data that is not chat or has no held-out split, and none
    from a streamed corpus (its held-out rows are token windows, no conversations are kept)."""
    if isinstance(source, MixedSource):          # each source's held-out conversations, in order
        out: list[EvalPrompt] = []
        for part in source.sources:
            out += heldout_chat_prompts(part, cfg, tokenizer, n - len(out)) if len(out) < n else []
        return out
    evaluation = source.eval_source
    if evaluation is not None:
        examples = evaluation.examples
        fmt = evaluation.format
    elif isinstance(source, StreamingSource):
        return []
    else:
        _, heldout, _ = plan_heldout(len(source.examples), cfg.heldout_fraction, cfg.seed, source.name)
        examples, fmt = [source.examples[i] for i in heldout], source.format
    if fmt != "chat":
        return []
    template = load_chat_template(cfg.chat_template)
    return [chat_prompt(ex, tokenizer, template) for ex in examples[:n]]


def resolve_eval_prompts(prompts_path: str | None, source: Source | StreamingSource | None, cfg: DataConfig,
                         tokenizer: Any) -> list[EvalPrompt]:
    """The prompts sampled at each evaluation: --eval-prompts, else held-out chat prompts, else none."""
    if prompts_path is not None:
        if tokenizer is None:
            raise DataError(f"--eval-prompts {prompts_path}: the model has no tokenizer to encode the prompts "
                            f"and decode the samples")
        return read_prompt_file(prompts_path, tokenizer, load_chat_template(cfg.chat_template))
    if source is None or tokenizer is None:
        return []
    return heldout_chat_prompts(source, cfg, tokenizer)


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """A prompt's ids as training sees a text: BOS first where the tokenizer has one (a chat
    template may have written it already), no EOS."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos, eos = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)
    if bos is not None and bos != eos and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids


def decode_completion(tokenizer: Any, ids: list[int]) -> str:
    """A sample's text, as generated: no clean-up of spaces (BPE tokenizers warn that it corrupts theirs)."""
    return tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def greedy_completions(next_token_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                       prompts: list[list[int]], seq_len: int, rows: int, max_new_tokens: int,
                       eos_id: int | None, pad_id: int,
                       agree: Callable[[list[int]], list[int]] = lambda picks: picks) -> list[list[int]]:
    """The greedy continuation ids of each prompt (ending before EOS), `rows` prompts a batch.

    Each new token is one full forward (`next_token_logits(ids [rows, seq_len], lengths [rows])
    -> [rows, V]`): no KV cache; the rows are right-padded to one width (the module docstring). A
    prompt longer than seq_len - 1 keeps its last tokens; a row stops at EOS, after max_new_tokens,
    or at seq_len tokens. `agree` makes every rank take the
    same tokens (rank 0's) under data parallel, so every rank runs the same forwards."""
    prompts = [p[-(seq_len - 1):] for p in prompts]
    rows = min(rows, len(prompts))
    longest = max((len(p) for p in prompts), default=1) + max_new_tokens
    width = min(seq_len, -(-longest // WIDTH_STEP) * WIDTH_STEP)       # one shape for every evaluation
    out: list[list[int]] = []
    for start in range(0, len(prompts), rows):
        chunk = prompts[start:start + rows]
        ids = torch.full((rows, width), pad_id, dtype=torch.long)                  # [rows, W]
        lengths = torch.ones(rows, dtype=torch.long)                               # [rows]; filler rows: 1
        for r, p in enumerate(chunk):
            ids[r, :len(p)] = torch.tensor(p, dtype=torch.long)
            lengths[r] = len(p)
        new: list[list[int]] = [[] for _ in chunk]
        live = [True] * len(chunk)
        for _ in range(max_new_tokens):
            if not any(live):
                break
            picks = agree(next_token_logits(ids, lengths).argmax(-1).tolist())  # [rows]
            for r in range(len(chunk)):
                if not live[r]:
                    continue
                if picks[r] == eos_id:
                    live[r] = False
                    continue
                new[r].append(picks[r])
                ids[r, lengths[r]] = picks[r]
                lengths[r] += 1
                live[r] = int(lengths[r]) < width
        out.extend(new)
    return out


def write_samples(path: Path, step: int, samples: list[tuple[str, str]]) -> None:
    """Append each (prompt, completion) of the evaluation after `step` to eval_samples.jsonl."""
    with open(path, "a", encoding="utf-8") as f:
        for prompt, completion in samples:
            f.write(json.dumps({"step": step, "prompt": prompt, "completion": completion}, ensure_ascii=False)
                    + "\n")


def keep_samples_up_to(path: Path, resume_step: int | None) -> None:
    """Before the first evaluation: a fresh start (None) removes an earlier run's eval_samples.jsonl;
    a resume keeps its lines up to the checkpoint's step (those after it are sampled again)."""
    if not path.exists():
        return
    if resume_step is None:
        path.unlink()
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if int(json.loads(line)["step"]) <= resume_step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue            # a line cut short by a kill: dropped, as the trackers drop theirs
    path.write_text("".join(kept), encoding="utf-8")
