"""Reading a data source into a list of `Example`s (untokenized).

Accepted sources (``DataConfig.path``):

* ``.txt`` / ``.text`` / ``.md``: UTF-8 plain text, split into documents at blank lines
  (one or more lines holding only whitespace). Each document gets EOS after it, like the
  documents of a pretraining corpus, and the held-out split picks whole documents. Use JSONL
  ``{"text": ...}`` records for documents that contain blank lines themselves.
* ``.jsonl`` / ``.ndjson``: one JSON object per line (blank lines skipped). The format is
  detected per line from its keys, first match wins (extra keys are ignored):
    1. ``messages``                      chat: a list of {"role", "content"} rendered with the
                                         tokenizer's chat template; assistant turns supervised
                                         (``content`` null in a turn with ``tool_calls``; a
                                         ``tools`` key is passed to the template)
    2. ``conversations``                 ShareGPT: a list of {"from", "value"}, roles human / gpt /
                                         system (and the other names `SHAREGPT_ROLES` lists), an
                                         optional top-level ``system`` string: read as chat
    3. ``instruction`` + ``output``      alpaca (``input`` optional), rendered with
                                         `ALPACA_PROMPT` / `ALPACA_PROMPT_NO_INPUT`
    4. ``prompt`` + ``completion``       prompt-completion; the completion is supervised. Both
                                         strings, or both lists of messages (TRL's conversational
                                         prompt-completion: rendered as one chat, only the
                                         completion's assistant turns supervised)
    5. ``text``                          plain text, fully supervised
  All lines must share one format. A set whose columns are named otherwise is read through a
  `ColumnMap` (``--data-columns question=prompt,answer=completion``: TRL's dataset_text_field
  and the like), each record's columns renamed before its format is detected.
* anything else `datasets` reads (hf_datasets.py, chosen by sources.py): a ``.parquet``/``.csv``/
  ``.json``/``.arrow`` file, a directory of them, a ``save_to_disk`` directory, a Hub dataset id
  ``org/name``. The ``train`` split (or the only one) is used; each row is read like a JSONL line.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from .errors import DataError

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".ndjson")

# The Stanford Alpaca prompt (github.com/tatsu-lab/stanford_alpaca), the template alpaca-format
# datasets were written for. The response (`output`) follows the prompt directly.
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)

# (format name, required keys), in detection order.
FORMATS: tuple[tuple[str, frozenset[str]], ...] = (
    ("chat", frozenset({"messages"})),
    ("sharegpt", frozenset({"conversations"})),
    ("alpaca", frozenset({"instruction", "output"})),
    ("prompt_completion", frozenset({"prompt", "completion"})),
    ("text", frozenset({"text"})),
)
_ACCEPTED = "; ".join(
    ["{'messages'}", "{'conversations'} (ShareGPT)", "{'instruction', 'output'} (+ optional 'input')",
     "{'prompt', 'completion'}", "{'text'}"]
)
# ShareGPT's speaker names (``from``) as chat roles: the original's human / gpt / system, and the
# names other ShareGPT-style sets use (LLaMA-Factory's function_call / observation among them)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
                  "system": "system", "tool": "tool", "observation": "tool", "function_response": "tool",
                  "function_call": "assistant"}


@dataclass(frozen=True)
class Segment:
    """A piece of an example's text, tokenized on its own (see tokenization.py)."""

    text: str
    supervised: bool  # True: its tokens are training targets; False: prompt (masked if mask_prompt)


@dataclass
class Example:
    """One document or training example, before tokenization.

    Exactly one of ``segments`` / ``messages`` is set: chat examples need the tokenizer's
    chat template to become segments, so that happens in tokenization.py.
    """

    format: str                                   # "text" | "chat" | "prompt_completion" | "alpaca"
    where: str                                    # "file.jsonl:12" (1-based line) for messages
    segments: list[Segment] | None = None
    messages: list[dict[str, Any]] | None = field(default=None)
    tools: list[dict[str, Any]] | None = None     # chat: the record's tool schemas, for the template
    # chat: the first `prompt_turns` messages are the prompt (conversational prompt-completion):
    # their assistant turns are context, not targets; 0: every assistant turn is supervised
    prompt_turns: int = 0


@dataclass
class Source:
    """All examples of one data source."""

    name: str            # the path, or "<builtin corpus>"
    format: str          # the one format shared by all examples
    examples: list[Example]
    # the examples of DataConfig.eval_path, read with these (load_source): evaluated instead of a
    # held-out split
    eval_source: "Source | None" = None


# the record fields a ColumnMap may name (every format's keys)
# a preference pair's keys (data/preference.py reads such records; supervised runs refuse them)
PREFERENCE_KEYS = ("chosen", "rejected")
RECORD_FIELDS = frozenset({"messages", "tools", "conversations", "system", "instruction", "input", "output",
                           "prompt", "completion", "text", "chosen", "rejected"})     # (pairs: preference.py)


@dataclass(frozen=True)
class ColumnMap:
    """A data set's own column names for the record fields slidetune reads: ``content=text`` (a
    text column named content), ``question=prompt,answer=completion``. Each record's columns are
    renamed before its format is detected; a field the record has under its own name as well is
    replaced by the mapped column."""
    renames: tuple[tuple[str, str], ...] = ()      # (the data's column, slidetune's field)

    @classmethod
    def parse(cls, text: str | None) -> "ColumnMap | None":
        """--data-columns' value; None for none. ValueError naming the part that is wrong."""
        if text is None or not text.strip():
            return None
        pairs = []
        for part in text.split(","):
            theirs, sep, ours = (x.strip() for x in part.partition("="))
            if not sep or not theirs or not ours:
                raise ValueError(f"--data-columns: {part.strip()!r} is not COLUMN=FIELD (e.g. "
                                 f"'question=prompt,answer=completion')")
            if ours not in RECORD_FIELDS:
                raise ValueError(f"--data-columns: {ours!r} is not a record field slidetune reads; one of "
                                 f"{', '.join(sorted(RECORD_FIELDS))}")
            pairs.append((theirs, ours))
        targets = [ours for _, ours in pairs]
        if len(set(targets)) != len(targets):
            raise ValueError(f"--data-columns: two columns map to one field in {text!r}")
        return cls(tuple(pairs))

    def apply(self, record: dict, where: str) -> dict:
        """The record with its mapped columns under slidetune's names (a missing one: DataError)."""
        out = dict(record)
        for theirs, ours in self.renames:
            if theirs not in record:
                raise DataError(f"{where}: --data-columns maps column {theirs!r} to {ours!r}, but this record has "
                                f"no {theirs!r} (its columns: {sorted(record)})")
            out.pop(theirs)
            out[ours] = record[theirs]
        return out


def detect_format(keys: Iterable[str]) -> str | None:
    """The format whose required keys are all present (first match in `FORMATS`), or None."""
    keys = set(keys)
    for name, required in FORMATS:
        if required <= keys:
            return name
    return None


def _str_field(record: dict, key: str, where: str, optional: bool = False) -> str:
    value = record.get(key)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: '{key}' must be a string, got {type(value).__name__}")
    return value


def _parse_messages(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise DataError(f"{where}: 'messages' must be a list of {{role, content}} objects, "
                        f"got {type(value).__name__}")
    if not value:
        raise DataError(f"{where}: 'messages' is an empty list")
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise DataError(f"{where}: messages[{i}] must be an object with 'role' and "
                            f"'content', got {type(msg).__name__}")
        for key in ("role", "content"):
            if key == "content" and msg.get(key) is None and msg.get("tool_calls"):
                continue  # a tool-call turn: {"role": "assistant", "content": null, "tool_calls": [...]}
            if not isinstance(msg.get(key), str):
                got = "missing" if key not in msg else type(msg[key]).__name__
                raise DataError(f"{where}: messages[{i}]['{key}'] must be a string, got {got}")
        if msg.get("tool_calls") is not None and not isinstance(msg["tool_calls"], list):
            raise DataError(f"{where}: messages[{i}]['tool_calls'] must be a list, "
                            f"got {type(msg['tool_calls']).__name__}")
    return value


def _parse_tools(value: Any, where: str) -> list[dict[str, Any]] | None:
    """A chat record's ``tools``: a list of tool schemas (objects), or a JSON string of one (as
    datasets often store them); None when absent."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: 'tools' is a string but not JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataError(f"{where}: 'tools' must be a list of tool schema objects, got {type(value).__name__}")
    return value or None


def _sharegpt_messages(record: dict, where: str) -> list[dict[str, Any]]:
    """A ShareGPT record's ``conversations`` ([{"from", "value"}]) as chat messages, after its
    top-level ``system`` string where it has one."""
    turns = record["conversations"]
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: 'conversations' must be a non-empty list of {{from, value}} objects, got "
                        f"{'an empty list' if isinstance(turns, list) else type(turns).__name__}")
    messages = []
    system = record.get("system")
    if system is not None and not isinstance(system, str):
        raise DataError(f"{where}: 'system' must be a string, got {type(system).__name__}")
    if system and system.strip():
        messages.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(f"{where}: conversations[{i}] must be an object with 'from' and 'value', "
                            f"got {type(turn).__name__}")
        speaker, value = turn.get("from"), turn.get("value")
        if not isinstance(value, str):
            got = "missing" if "value" not in turn else type(value).__name__
            raise DataError(f"{where}: conversations[{i}]['value'] must be a string, got {got}")
        role = SHAREGPT_ROLES.get(str(speaker).lower()) if isinstance(speaker, str) else None
        if role is None:
            raise DataError(f"{where}: conversations[{i}]['from'] is {speaker!r}, not a ShareGPT speaker: "
                            f"one of {', '.join(sorted(SHAREGPT_ROLES))}")
        messages.append({"role": role, "content": value})
    return messages


def _conversational_prompt_completion(record: dict, where: str) -> Example:
    """TRL's conversational prompt-completion (``prompt`` and ``completion`` lists of messages):
    one chat, the prompt's turns context only."""
    prompt = _parse_messages(record["prompt"], f"{where} (prompt)")
    completion = _parse_messages(record["completion"], f"{where} (completion)")
    if not any(m["role"] == "assistant" for m in completion):
        raise DataError(f"{where}: the completion has no assistant message, so nothing would be trained on")
    return Example("chat", where, messages=prompt + completion, tools=_parse_tools(record.get("tools"), where),
                   prompt_turns=len(prompt))


def parse_record(record: Any, where: str, columns: ColumnMap | None = None) -> Example:
    """One JSON object (or datasets row) -> Example, its columns renamed by ``columns`` first;
    raises DataError naming ``where``."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if columns is not None:
        record = columns.apply(record, where)
    fmt = detect_format(record.keys())
    if fmt is None and all(k in record for k in PREFERENCE_KEYS):
        # a preference pair (data/preference.py) in a supervised run, which trains one completion
        raise DataError(f"{where}: a preference record (chosen/rejected) is not supervised fine-tuning data; "
                        f"to fine-tune on the chosen side, rename it: --data-columns chosen=completion "
                        f"(with a 'prompt' field)")
    if fmt is None:
        raise DataError(f"{where}: keys {sorted(record.keys())} match no known format; "
                        f"accepted key sets: {_ACCEPTED}")
    if fmt == "chat":
        return Example(fmt, where, messages=_parse_messages(record["messages"], where),
                       tools=_parse_tools(record.get("tools"), where))
    if fmt == "sharegpt":
        return Example("chat", where, messages=_sharegpt_messages(record, where),
                       tools=_parse_tools(record.get("tools"), where))
    if fmt == "prompt_completion" and isinstance(record["prompt"], list) and isinstance(record["completion"], list):
        return _conversational_prompt_completion(record, where)
    if fmt == "alpaca":
        instruction = _str_field(record, "instruction", where)
        inp = _str_field(record, "input", where, optional=True)
        output = _str_field(record, "output", where)
        prompt = (ALPACA_PROMPT.format(instruction=instruction, input=inp) if inp.strip()
                  else ALPACA_PROMPT_NO_INPUT.format(instruction=instruction))
        return Example(fmt, where, segments=[Segment(prompt, False), Segment(output, True)])
    if fmt == "prompt_completion":
        prompt = _str_field(record, "prompt", where)
        completion = _str_field(record, "completion", where)
        return Example(fmt, where, segments=[Segment(prompt, False), Segment(completion, True)])
    return Example(fmt, where, segments=[Segment(_str_field(record, "text", where), True)])


def check_one_format(examples: list[Example], name: str) -> str:
    if not examples:
        raise DataError(f"{name}: no examples found (the source is empty)")
    first = examples[0]
    for ex in examples[1:]:
        if ex.format != first.format:
            raise DataError(f"{ex.where}: this record is '{ex.format}' data but {first.where} is "
                            f"'{first.format}'; all records of a file must share one format")
    return first.format


def jsonl_records(path: str) -> Iterator[tuple[str, Any]]:
    """(where, record) of each non-blank line of a JSONL file, where = "path:line"."""
    with open(path, "rb") as f:
        data = f.read()
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        where = f"{path}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
        if not line.strip():
            continue
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: malformed JSON: {e.msg} (column {e.colno})") from None


def read_jsonl(path: str, columns: ColumnMap | None = None) -> Source:
    examples: list[Example] = []
    for where, record in jsonl_records(path):
        examples.append(parse_record(record, where, columns))
        if examples[-1].format != examples[0].format:
            check_one_format(examples, path)  # raises, naming both lines
    return Source(path, check_one_format(examples, path), examples)


_BLANK_LINES = re.compile(r"\n(?:[ \t\r\f\v]*\n)+")
_LEADING_BLANK_LINES = re.compile(r"^(?:[ \t\r\f\v]*\n)+")


def read_text(path: str) -> Source:
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    text = text.replace("\r\n", "\n")
    examples: list[Example] = []
    pos = 0
    for match in list(_BLANK_LINES.finditer(text)) + [None]:
        end = match.start() if match else len(text)
        doc = text[pos:end]
        if doc.strip():
            # 1-based line of the document's first non-blank line, for messages.
            first = pos + (len(doc) - len(doc.lstrip()))
            line = text.count("\n", 0, first) + 1
            doc = _LEADING_BLANK_LINES.sub("", doc).rstrip()  # keeps the first line's indent
            examples.append(Example("text", f"{path}:{line}", segments=[Segment(doc, True)]))
        if match:
            pos = match.end()
    if not examples:
        raise DataError(f"{path}: no documents found (the file is empty or only whitespace)")
    return Source(path, "text", examples)


def read_source(path: str) -> Source:
    """Read a local ``.jsonl`` or ``.txt`` file into a `Source`; see the module docstring
    (sources.read_source reads every other kind of source, through `datasets`)."""
    if not os.path.exists(path):
        raise DataError(f"data path {path} does not exist")
    lower = path.lower()
    if lower.endswith(JSONL_SUFFIXES):
        return read_jsonl(path)
    if lower.endswith(TEXT_SUFFIXES):
        return read_text(path)
    raise DataError(f"{path}: not a {', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} file (sources.read_source reads "
                    f"the others)")


def texts_source(texts: list[str], name: str) -> Source:
    """Plain documents (e.g. the built-in corpus) as a text `Source`; ``where`` is "name[i]"."""
    examples = [Example("text", f"{name}[{i}]", segments=[Segment(t, True)])
                for i, t in enumerate(texts) if t.strip()]
    return Source(name, "text", examples)
