"""Examples -> token ids plus a per-token target mask.

Rules (one place, so that packing and padding never have to know about formats):

* Every `Segment` is encoded on its own with ``add_special_tokens=False`` and the pieces are
  concatenated. Encoding the prompt alone is what generation does (the prompt is encoded,
  the reply is sampled after it), so training sees the same prompt tokens as inference.
* BOS: prepended when the tokenizer has a ``bos_token`` and the sequence does not already
  start with it (a chat template may write it itself), except when BOS == EOS (GPT-2's
  ``<|endoftext|>``): there the EOS that ends the previous document already marks the start
  of the next, and doubling it would teach "EOS EOS". BOS is never a target.
* EOS: appended after every document/example unless it already ends with it, or with its
  text followed by whitespace (ChatML templates end a turn with ``<|im_end|>\\n``). It is a
  target when the token before it is (text: always; prompt-completion: yes; chat: when the
  conversation ends with an assistant turn), so the model learns to stop.
* ``targets[i]`` is True when token i is a training target. Prompt segments are not
  targets when ``mask_prompt`` (otherwise everything but BOS is). Labels are built from this
  mask after the shift (batch.py), so masking is carried along the shift by construction.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from .chat_template import (effective_template, load_chat_template, marks_generation, masked_chat_tokens,
                            shipped_equivalent, shipped_templates)
from .errors import DataError
from .formats import Example, Segment

# Texts per tokenizer call: batched calls let a fast tokenizer use its Rust threads, chunks
# keep the temporary Python lists of a large corpus bounded.
ENCODE_CHUNK = 4096


@dataclass
class TokenizedExample:
    ids: list[int]        # [L] token ids, BOS/EOS included
    targets: list[bool]   # [L] True where the token is a training target
    where: str            # the example's source location, for messages


def special_ids(tokenizer: Any, source_name: str) -> tuple[int | None, int]:
    """(BOS id to prepend or None, EOS id); raises DataError when there is no EOS."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DataError(f"{source_name}: the tokenizer has no eos_token, which is needed to end "
                        f"each document; set tokenizer.eos_token")
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos == eos:
        bos = None
    return bos, eos


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool, where: str,
            **template: Any) -> str:
    """``template``: apply_chat_template's chat_template (None: the tokenizer's) and tools."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation_prompt, **template)
    except Exception as e:  # template errors (e.g. "roles must alternate") come as many types
        raise DataError(f"{where}: the tokenizer's chat template failed on this conversation: "
                        f"{type(e).__name__}: {e}") from e
    if not isinstance(text, str):
        raise DataError(f"{where}: apply_chat_template(tokenize=False) returned "
                        f"{type(text).__name__}, expected str")
    return text


def _opening_prompt(tokenizer: Any, upto: str, where: str, **template: Any) -> str | None:
    """The prompt of a conversation's opening assistant turn, or None if not found.

    An empty conversation cannot be rendered (transformers refuses it), so the assistant
    header ("<|im_start|>assistant\\n") is taken from a one-message probe, the text that
    add_generation_prompt adds, and the prompt ends after its first occurrence (templates may
    put a default system prompt before it).
    """
    probe = [{"role": "user", "content": "x"}]
    try:
        with_header = _render(tokenizer, probe, True, where, **template)
        without = _render(tokenizer, probe, False, where, **template)
    except DataError:
        return None
    header = with_header[len(without):]
    if not with_header.startswith(without) or not header or header not in upto:
        return None
    return upto[: upto.index(header) + len(header)]


def chat_segments(messages: list[dict], tokenizer: Any, mask_prompt: bool, where: str, prompt_turns: int = 0,
                  **template: Any) -> list[Segment]:
    """Render a conversation with the chat template and mark the assistant turns.

    Assistant turn i is the text that ``render(messages[:i+1])`` adds after
    ``render(messages[:i], add_generation_prompt=True)``: its content plus the template's
    end-of-turn marker (e.g. ``Hello<|im_end|>\\n``), the part the model must generate. This
    needs a template whose renderings of a conversation's prefixes are prefixes of the full
    rendering (true of ChatML and Llama-3 templates); otherwise a DataError explains.
    ``template``: apply_chat_template's chat_template and tools. The assistant turns among the
    first ``prompt_turns`` messages (a conversational prompt-completion's prompt) stay prompt.
    """
    full = _render(tokenizer, messages, False, where, **template)
    if not mask_prompt:
        return [Segment(full, True)]
    segments: list[Segment] = []
    cursor = 0  # end of the text assigned to segments so far
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant" or i < prompt_turns:
            continue
        upto = _render(tokenizer, messages[: i + 1], False, where, **template)
        prompt: str | None
        if i > 0:
            prompt = _render(tokenizer, messages[:i], True, where, **template)
        else:
            prompt = _opening_prompt(tokenizer, upto, where, **template)
        locatable = (prompt is not None and upto.startswith(prompt) and full.startswith(upto)
                     and len(prompt) >= cursor)
        if not locatable:
            raise DataError(
                f"{where}: cannot locate assistant message {i} in the chat template's output: "
                f"rendering the conversation up to it is not a prefix of the full rendering "
                f"(the template rewrites earlier turns); give a template that marks the assistant "
                f"turns with {{% generation %}} blocks (--chat-template FILE, or a shipped one: "
                f"{', '.join(shipped_templates())}), use prompt/completion records instead, or "
                f"mask_prompt=False"
            )
        assert prompt is not None
        segments.append(Segment(full[cursor:len(prompt)], False))
        segments.append(Segment(full[len(prompt):len(upto)], True))
        cursor = len(upto)
    segments.append(Segment(full[cursor:], False))
    return [s for s in segments if s.text]


def _example_pieces(ex: Example, tokenizer: Any, mask_prompt: bool, source_name: str,
                    chat_template: str | None, adopted: set[str]) -> list[Segment] | tuple[list[int], list[bool]]:
    """Segments to encode, or for chat with a generation-marked template its (ids, targets).
    ``adopted`` collects the shipped templates whose masks stood in for the tokenizer's template."""
    if ex.messages is None:
        assert ex.segments is not None
        return ex.segments
    template = effective_template(tokenizer, chat_template, ex.tools)
    if template is None:
        raise DataError(f"{source_name}: chat data ('messages' at {ex.where}) needs a tokenizer with a chat "
                        f"template, and this tokenizer has none; pass --chat-template FILE|NAME (shipped: "
                        f"{', '.join(shipped_templates())}), set tokenizer.chat_template, or write the "
                        f"data as prompt/completion")
    if mask_prompt and marks_generation(template):
        return masked_chat_tokens(tokenizer, ex.messages, ex.tools, template, ex.where, ex.prompt_turns)
    try:
        return chat_segments(ex.messages, tokenizer, mask_prompt, ex.where, ex.prompt_turns, chat_template=template,
                             tools=ex.tools)
    except DataError:
        # e.g. Qwen3's or Phi-3.5's published template: a shipped copy that renders the same text
        # marks the assistant turns in it
        name = None if chat_template is not None else shipped_equivalent(tokenizer, template, ex.messages,
                                                                          ex.tools)
        if name is None:
            raise
        adopted.add(name)
        shipped = load_chat_template(name)
        assert shipped is not None
        return masked_chat_tokens(tokenizer, ex.messages, ex.tools, shipped, ex.where, ex.prompt_turns)


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    out: list[list[int]] = []
    for start in range(0, len(texts), ENCODE_CHUNK):
        chunk = texts[start:start + ENCODE_CHUNK]
        out.extend(list(ids) for ids in tokenizer(chunk, add_special_tokens=False)["input_ids"])
    return out


def _ends_with_text(segments: list[Segment], eos_text: str | None) -> bool:
    """Whether the text ends with the EOS token's text plus only whitespace: chat templates
    end turns with EOS and a newline (ChatML: ``<|im_end|>\\n``); another EOS is not needed."""
    if not eos_text or not segments:
        return False
    return "".join(s.text for s in segments).rstrip().endswith(eos_text)


def _ends_with_eos(tokenizer: Any, ids: list[int], eos: int) -> bool:
    """Whether ``ids`` end with EOS followed only by whitespace tokens (``<|im_end|>\\n``)."""
    tail = ids[-8:]  # templates put at most a newline or two after a turn's EOS
    if eos not in tail:
        return False
    last = len(tail) - 1 - tail[::-1].index(eos)
    return not tokenizer.decode(tail[last + 1:]).strip()


def tokenize_examples(examples: list[Example], tokenizer: Any, mask_prompt: bool, source_name: str,
                      chat_template: str | None = None) -> list[TokenizedExample]:
    """Tokenize examples in order; see the module docstring for BOS/EOS/target rules.
    ``chat_template``: the Jinja text that renders chat examples (None: the tokenizer's)."""
    bos, eos = special_ids(tokenizer, source_name)
    eos_text = getattr(tokenizer, "eos_token", None)
    adopted: set[str] = set()
    per_example = [_example_pieces(ex, tokenizer, mask_prompt, source_name, chat_template, adopted)
                   for ex in examples]
    if adopted:
        names = ", ".join(sorted(adopted))
        warnings.warn(f"{source_name}: the tokenizer's chat template renders earlier turns differently once "
                      f"later ones exist, so the assistant turns cannot be found by comparing renderings; the "
                      f"shipped template {names} renders these chats to the same text and marks the assistant "
                      f"turns: its masks are used (--chat-template {names} says so and skips this check)",
                      stacklevel=2)
    encoded = iter(_encode(tokenizer, [s.text for p in per_example if isinstance(p, list) for s in p]))
    out: list[TokenizedExample] = []
    for ex, pieces in zip(examples, per_example):
        ids: list[int] = []
        targets: list[bool] = []
        if isinstance(pieces, tuple):
            ids, targets = pieces
            ends_with_eos = bool(ids) and _ends_with_eos(tokenizer, ids, eos)
        else:
            for seg in pieces:
                piece = next(encoded)
                ids += piece
                targets += [seg.supervised or not mask_prompt] * len(piece)
            ends_with_eos = bool(ids) and (ids[-1] == eos or _ends_with_text(pieces, eos_text))
        if bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
            targets.insert(0, False)
        if not ends_with_eos:
            ids.append(eos)
            targets.append(targets[-1] if targets else True)
        if ids[0] == bos:
            targets[0] = False  # BOS is never a target (a chat template may have written it)
        out.append(TokenizedExample(ids, targets, ex.where))
    return out


def default_pad_id(tokenizer: Any) -> int:
    """The pad id to give `BatchSampler`: the tokenizer's pad token, else its EOS.

    Padded positions are never attended to (attention_mask 0) nor trained on (label -100),
    so any id works; EOS is the usual stand-in for tokenizers without a pad token.
    """
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    if pad is None:
        raise DataError("the tokenizer has neither a pad_token nor an eos_token")
    return int(pad)
