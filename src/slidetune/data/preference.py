"""Preference pairs (issue 47): TRL's preference records read into a pair of examples.

Accepted records (a JSONL line or a `datasets` row, renamed by a `ColumnMap` first), TRL's
preference type in both of its formats:

    {"prompt": P, "chosen": C, "rejected": R}   P, C, R strings (standard) or lists of
                                                {role, content} messages (conversational)
    {"chosen": C, "rejected": R}                the implicit prompt: the part both sides share
                                                is the prompt (`implicit_prompt`)

Each side becomes the prompt-completion `Example` formats.py reads for SFT: the prompt out of the
loss, the completion in it; a conversational side is one chat whose prompt turns are context
(rendered with the chat template as SFT chats are). A record whose fields are missing, of mixed
kinds, equal on both sides, or leave a side with nothing to score is refused naming the record
and the field.

Tokens (`tokenize_pair`) are made as TRL's DPOTrainer makes them (trl 1.16, the version the tests
pin), so a pair's ids are TRL's: the prompt alone, prompt + chosen and prompt + rejected each
tokenized whole (a standard record's completions end with EOS; a conversation is rendered with the
chat template, the prompt with the generation prompt), each completion starting where its ids
leave the prompt's. `collate_pairs` is TRL's collator: every sequence cut to `max_length` (its
start kept), the chosen rows then the rejected rows, padded on the right, a completion mask
marking the tokens scored; `drop_unscored` leaves out the pairs whose prompt fills `max_length`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import torch

from .batch import IGNORE_INDEX, Batch
from .errors import DataError
from .formats import PREFERENCE_KEYS, ColumnMap, Example, parse_record

if TYPE_CHECKING:
    from ..objectives.preference import PreferenceConfig

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class PreferencePair:
    """One preference record: the same prompt completed two ways."""
    where: str               # "path line N" / "<source> row N"
    chosen: Example          # prompt + the preferred completion
    rejected: Example        # prompt + the dispreferred completion
    implicit_prompt: bool    # the prompt was the sides' shared part (no `prompt` field)


def is_preference(keys: Iterable[str]) -> bool:
    """Whether a record's keys are a preference record's (`chosen` and `rejected`)."""
    keys = set(keys)
    return all(k in keys for k in PREFERENCE_KEYS)


def implicit_prompt(chosen: str | list, rejected: str | list) -> tuple[str | list, str | list, str | list]:
    """(prompt, chosen, rejected) of a record without a prompt, by TRL's rule (`extract_prompt`):
    the sides' common prefix (characters of two strings, whole messages of two conversations),
    less a space that ends it (the space then opens each completion). Where one side is a prefix
    of the other the rule stops one element short of the shorter side, as TRL's loop does, so
    each side keeps at least its last element."""
    n = min(len(chosen), len(rejected))
    if n == 0:
        return chosen[:0], chosen, rejected
    idx = n - 1                      # TRL's loop variable where no element differs
    for i in range(n):
        if chosen[i] != rejected[i]:
            idx = i - 1 if i > 0 and chosen[i - 1] == " " else i
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _kind(value: Any) -> str:
    return "list of messages" if isinstance(value, list) else type(value).__name__


def _blank(value: str | list) -> bool:
    return not value if isinstance(value, list) else not value.strip()


def parse_pair(record: Any, where: str, columns: ColumnMap | None = None) -> PreferencePair:
    """One preference record -> PreferencePair; DataError naming `where` and the field at fault."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if columns is not None:
        record = columns.apply(record, where)
    missing = [k for k in PREFERENCE_KEYS if k not in record]
    if missing:
        raise DataError(f"{where}: a preference record needs 'chosen' and 'rejected' (and optionally 'prompt'); "
                        f"'{missing[0]}' is missing (keys: {sorted(record)})")
    chosen, rejected, prompt = record["chosen"], record["rejected"], record.get("prompt")
    conversational = isinstance(chosen, list)
    for key, value in (("chosen", chosen), ("rejected", rejected), ("prompt", prompt)):
        if value is None and key == "prompt":
            continue
        if not isinstance(value, list if conversational else str):
            raise DataError(f"{where}: '{key}' is a {_kind(value)} but 'chosen' is a {_kind(chosen)}: a record's "
                            f"prompt, chosen and rejected are all strings (standard) or all lists of "
                            f"{{role, content}} messages (conversational)")
    if chosen == rejected:
        raise DataError(f"{where}: 'chosen' and 'rejected' are the same, so the pair prefers nothing; "
                        f"leave it out of the data")
    implicit = prompt is None
    if implicit:
        prompt, chosen, rejected = implicit_prompt(chosen, rejected)
        if conversational and not prompt:
            raise DataError(f"{where}: 'chosen' and 'rejected' share no message, so the record has no prompt; "
                            f"give a 'prompt' field or lists that begin with the same turns")
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        if _blank(value):
            raise DataError(f"{where}: '{key}' is empty"
                            + (" once the prompt both sides share is taken out" if implicit else "")
                            + ": each side of a pair needs a completion to score")
    extra = {"tools": record["tools"]} if conversational and record.get("tools") is not None else {}
    sides = [parse_record({"prompt": prompt, "completion": side, **extra}, f"{where} ({key})")
             for key, side in (("chosen", chosen), ("rejected", rejected))]
    return PreferencePair(where, sides[0], sides[1], implicit)


@dataclass(frozen=True)
class TokenizedPair:
    """A pair's token ids: the prompt both sides share, then each side's completion."""
    where: str
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    prompt_cut: int = 0      # prompt tokens the completions re-render (the template or a merge)


def _ids(tokenizer: Any, value: str | list, template: dict, generation_prompt: bool, where: str) -> list[int]:
    """Token ids of a string (the tokenizer's own special tokens added) or of a conversation
    (rendered with the chat template), as TRL's `_tokenize`."""
    try:
        if isinstance(value, list):
            out = tokenizer.apply_chat_template(value, tokenize=True, return_dict=True,
                                                add_generation_prompt=generation_prompt, **template)
        else:
            out = tokenizer(text=value)
    except Exception as e:         # a template's own errors ("roles must alternate") come as many types
        raise DataError(f"{where}: tokenizing failed: {type(e).__name__}: {e}") from e
    return list(out["input_ids"])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_pair(pair: PreferencePair, tokenizer: Any, chat_template: str | None = None) -> TokenizedPair:
    """The pair's ids as TRL's DPOTrainer makes them (module docstring). `chat_template`: a
    template to render conversations with instead of the tokenizer's (--chat-template)."""
    if pair.chosen.messages is not None:
        turns = pair.chosen.prompt_turns
        prompt = pair.chosen.messages[:turns]
        sides = [pair.chosen.messages[turns:], pair.rejected.messages[turns:]]
        template = {k: v for k, v in (("tools", pair.chosen.tools), ("chat_template", chat_template)) if v}
        prompt_ids = _ids(tokenizer, prompt, template, True, pair.where)
        full = [_ids(tokenizer, prompt + side, template, False, f"{pair.where} ({name})")
                for side, name in zip(sides, PREFERENCE_KEYS)]
    else:
        prompt = pair.chosen.segments[0].text
        eos = getattr(tokenizer, "eos_token", None)
        sides = [ex.segments[1].text for ex in (pair.chosen, pair.rejected)]
        if eos:
            sides = [side if side.endswith(eos) else side + eos for side in sides]
        prompt_ids = _ids(tokenizer, prompt, {}, False, pair.where)
        full = [_ids(tokenizer, prompt + side, {}, False, f"{pair.where} ({name})")
                for side, name in zip(sides, PREFERENCE_KEYS)]
    n = min(_common_prefix(prompt_ids, ids) for ids in full)
    chosen, rejected = (ids[n:] for ids in full)
    for ids, name in ((chosen, "chosen"), (rejected, "rejected")):
        if not ids:
            raise DataError(f"{pair.where}: '{name}' adds no token to the prompt once tokenized")
    return TokenizedPair(pair.where, prompt_ids[:n], chosen, rejected, len(prompt_ids) - n)


def drop_unscored(pairs: list[TokenizedPair], max_length: int | None, source: str) -> list[TokenizedPair]:
    """The pairs with a token left to score once cut to `max_length` (TRL drops a pair whose prompt
    fills it: its start is kept, so neither completion would be). Says how many went."""
    if max_length is None:
        return pairs
    kept = [p for p in pairs if len(p.prompt) < max_length]
    if len(kept) < len(pairs):
        log.warning("%s: %d of %d pairs left out: their prompt fills max_length = %d tokens, so no completion "
                    "token would be scored", source, len(pairs) - len(kept), len(pairs), max_length)
    return kept


def collate_pairs(pairs: list[TokenizedPair], pad_id: int, max_length: int | None = None,
                  pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """A batch of B pairs as TRL's DataCollatorForPreference makes it: input_ids, attention_mask
    and completion_mask, each [2B, S] (rows 0..B-1 prompt + chosen, B..2B-1 prompt + rejected), every
    sequence cut to its first `max_length` tokens, padded on the right to the longest (or to
    `pad_to`, a fixed width)."""
    rows, masks = [], []
    for side in ("chosen", "rejected"):
        for p in pairs:
            completion = getattr(p, side)
            rows.append((p.prompt + completion)[:max_length])
            masks.append(([0] * len(p.prompt) + [1] * len(completion))[:max_length])
    width = max(len(r) for r in rows) if pad_to is None else pad_to
    if any(len(r) > width for r in rows):
        raise ValueError(f"collate_pairs: a sequence of {max(len(r) for r in rows)} tokens is longer than "
                         f"pad_to = {pad_to}")
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)          # [2B, S]
    attention = torch.zeros((len(rows), width), dtype=torch.long)           # [2B, S]
    completion = torch.zeros((len(rows), width), dtype=torch.long)          # [2B, S]
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        attention[i, :len(r)] = 1
        completion[i, :len(m)] = torch.tensor(m, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def pair_micro_batches(collated: dict[str, torch.Tensor], cfg: "PreferenceConfig",
                       ref_logps: torch.Tensor | None = None, micro_batches: int = 1) -> list[Batch]:
    """A step's pairs (collate_pairs' tensors, [2P, S]: the chosen rows, then the rejected rows) as
    `micro_batches` engine batches of whole pairs (right-padded, no attention mask): labels shifted as `collate`'s (label t is token
    t + 1), kept where a token is scored (a completion token; SimPO's NLL: the chosen completions,
    ORPO's: the chosen rows' every token after the first), and each batch's `pairs` telling the head
    which sequence a token sums into, the reference's sums [2P] (in the same order), and the step's
    pairs and NLL tokens (the means' denominators)."""
    from ..objectives.preference import PairTokens
    ids, attention, comp = collated["input_ids"], collated["attention_mask"], collated["completion_mask"]
    rows_total, width = ids.shape
    P = rows_total // 2
    if rows_total != 2 * P or P < micro_batches:
        raise ValueError(f"{rows_total} sequences cannot make {micro_batches} micro-batches of whole pairs")
    targets = torch.full_like(ids, IGNORE_INDEX)                   # [2P, S]: label t is token t + 1
    targets[:, :-1] = ids[:, 1:]
    completion = torch.zeros_like(ids, dtype=torch.bool)
    completion[:, :-1] = (comp[:, 1:] != 0) & (attention[:, 1:] != 0)
    real_next = torch.zeros_like(completion)
    real_next[:, :-1] = attention[:, 1:] != 0
    chosen_row = (torch.arange(rows_total) < P)[:, None]           # [2P, 1]
    nll = chosen_row & {"simpo": completion, "orpo": real_next}.get(cfg.objective, torch.zeros_like(completion))
    labels = targets.masked_fill(~(completion | nll), IGNORE_INDEX)
    nll_tokens = int(nll.sum())
    out = []
    for part in torch.arange(P).chunk(micro_batches):
        rows = torch.cat([part, part + P])                         # the micro-batch's chosen, then rejected
        pairs = PairTokens(torch.arange(len(rows)).repeat_interleave(width), completion[rows].reshape(-1),
                           nll[rows].reshape(-1), ref_logps[rows] if ref_logps is not None else None,
                           pairs_in_step=P, nll_tokens_in_step=nll_tokens)
        # no attention mask: the padding is on the right, so under the causal mask no real token
        # attends to it, and its labels are ignored (as the SFT collator's padded rows): the layers
        # keep SDPA's causal kernels instead of a [B, 1, S, S] mask's
        out.append(Batch(ids[rows], labels[rows], None, pairs=pairs))
    return out
