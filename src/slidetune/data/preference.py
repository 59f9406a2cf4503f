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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from .errors import DataError
from .formats import ColumnMap, Example, parse_record

PREFERENCE_KEYS = ("chosen", "rejected")


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
