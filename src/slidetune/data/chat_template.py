"""Chat templates for training: `--chat-template FILE|NAME` and assistant masks from
``{% generation %}`` blocks.

A template that wraps what the assistant writes in ``{% generation %}`` ... ``{% endgeneration %}``
(transformers' training templates, TRL's) lets `tokenizer.apply_chat_template(...,
return_assistant_tokens_mask=True)` mark the assistant tokens of a whole conversation in one
rendering. Templates without the blocks fall back to comparing renderings of the conversation's
prefixes (tokenization.chat_segments), which fails for templates that render earlier turns
differently once later ones exist (Qwen3 drops the thinking block of earlier replies; Phi-3.5
writes EOS after the last message). The package ships generation-marked copies of such templates
(``templates/NAME.jinja``), rendering exactly the text of the published ones; where the fallback
fails and a shipped template renders the conversation to the very text the tokenizer's renders,
its blocks mark the tokens (`shipped_equivalent`), with a warning that names it.
"""
from __future__ import annotations

import functools
import os
import re
from importlib import resources
from typing import Any

from .errors import DataError

# `{% generation %}` / `{%- generation -%}`: the block transformers' jinja extension records
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_SHIPPED_DIR = "templates"
_SUFFIX = ".jinja"


@functools.lru_cache(maxsize=None)
def _shipped_names() -> tuple[str, ...]:
    folder = resources.files(__package__) / _SHIPPED_DIR
    return tuple(sorted(p.name[: -len(_SUFFIX)] for p in folder.iterdir() if p.name.endswith(_SUFFIX)))


def shipped_templates() -> list[str]:
    """Names of the templates shipped in the package (``--chat-template NAME``)."""
    return list(_shipped_names())


def check_chat_template_setting(spec: str | None) -> None:
    """Raise ValueError when ``spec`` is neither an existing file nor a shipped template's name, and
    DataError (a ValueError) naming the file and line when the file is no valid Jinja template: with
    the configuration, before a model is loaded or a line of data tokenized."""
    if spec is not None and os.path.isfile(spec):
        load_chat_template(spec)
        return
    if spec is None or spec in shipped_templates():
        return
    raise ValueError(f"DataConfig.chat_template (--chat-template) {spec!r} is neither a file nor a template "
                     f"shipped with slidetune ({', '.join(shipped_templates())})")


@functools.lru_cache(maxsize=None)
def _shipped_text(name: str) -> str:
    return (resources.files(__package__) / _SHIPPED_DIR / (name + _SUFFIX)).read_text(encoding="utf-8")


def shipped_equivalent(tokenizer: Any, own: str, messages: list[dict], tools: list | None) -> str | None:
    """The name of a shipped template that renders this conversation to exactly the text ``own``
    renders (so the tokens are the same and its generation blocks mark them), or None."""
    def render(template: str) -> str | None:
        try:
            return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False)
        except Exception:  # a template that cannot render this conversation is no match
            return None

    text = render(own)
    if text is None:
        return None
    return next((name for name in shipped_templates() if render(_shipped_text(name)) == text), None)


def _check_syntax(spec: str, text: str) -> None:
    """Compile a --chat-template file's Jinja as transformers will render it (its environment, with
    the generation tag): a syntax error is named here, once, with the file and its line, not as the
    first conversation's failure (it is not about the data)."""
    try:
        import jinja2
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:      # a transformers without it: rendering reports the error (on a data line)
        return
    try:
        _compile_jinja_template(text)       # cached: the renderings reuse the compiled template
    except jinja2.TemplateSyntaxError as e:           # an unknown filter or test too (a subclass)
        lines = text.splitlines()
        where = f"line {e.lineno}" + (f" (`{lines[e.lineno - 1].strip()}`)" if 0 < e.lineno <= len(lines) else "")
        raise DataError(f"--chat-template {spec}: not a valid Jinja template: {where}: {e.message}") from e
    except ImportError:      # jinja2 older than transformers needs: rendering says so
        return


def load_chat_template(spec: str | None) -> str | None:
    """The Jinja text of ``spec`` (a file, else a shipped template's name); None stays None:
    the tokenizer's own template is used."""
    if spec is None:
        return None
    if os.path.isfile(spec):
        try:
            with open(spec, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"--chat-template {spec}: cannot read it as a UTF-8 Jinja file: {e}") from e
        if not text.strip():
            raise DataError(f"--chat-template {spec}: the file is empty")
        _check_syntax(spec, text)
        return text
    if spec in shipped_templates():
        return _shipped_text(spec)
    raise DataError(f"--chat-template {spec}: no such file, nor a template shipped with slidetune "
                    f"({', '.join(shipped_templates())})")


def effective_template(tokenizer: Any, override: str | None, tools: list | None = None) -> str | None:
    """The template text that renders a conversation: ``override``, else the tokenizer's (a
    dict of named templates resolves to the one transformers would pick), else None."""
    if override is not None:
        return override
    own = getattr(tokenizer, "chat_template", None)
    if not own:
        return None
    if isinstance(own, str):
        return own
    try:
        return tokenizer.get_chat_template(None, tools)
    except ValueError:
        return None


def marks_generation(template: str | None) -> bool:
    """Whether the template wraps the assistant's text in ``{% generation %}`` blocks."""
    return bool(template) and _GENERATION_TAG.search(template) is not None


def masked_chat_tokens(tokenizer: Any, messages: list[dict], tools: list | None, template: str,
                       where: str, prompt_turns: int = 0) -> tuple[list[int], list[bool]]:
    """(ids [L], targets [L]) of a conversation rendered with a generation-marked template:
    the tokens inside its ``{% generation %}`` blocks are the targets (the assistant's replies
    and their end-of-turn token), everything else is prompt; the first ``prompt_turns`` messages
    (a conversational prompt-completion's prompt) are prompt whatever their roles."""
    try:
        out = tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=True,
                                            return_dict=True, return_assistant_tokens_mask=True)
    except Exception as e:  # template errors (e.g. "roles must alternate") come as many types
        raise DataError(f"{where}: the chat template failed on this conversation: "
                        f"{type(e).__name__}: {e}") from e
    ids = [int(i) for i in out["input_ids"]]
    targets = [bool(m) for m in out["assistant_masks"]]
    if prompt_turns:
        n = _prompt_length(tokenizer, messages, tools, template, where, prompt_turns, ids)
        targets[:n] = [False] * n
    if any(m.get("role") == "assistant" for m in messages) and not any(targets):
        # char_to_token finds no token for a block's first character when the tokenizer drops it
        # (a whitespace pre-tokenizer), or a slow tokenizer has no offsets at all
        raise DataError(f"{where}: the chat template marks the assistant turns with {{% generation %}}, but no "
                        f"token of them was found (the tokenizer must be a fast tokenizer whose tokens cover "
                        f"every character); pass a template without generation blocks, or mask_prompt=False")
    return ids, targets


def _prompt_length(tokenizer: Any, messages: list[dict], tools: list | None, template: str, where: str,
                   prompt_turns: int, ids: list[int]) -> int:
    """Tokens of the conversation's first `prompt_turns` messages as `ids` (the whole rendering's)
    begin with them, the next assistant turn's header included; DataError where the template does
    not render that prefix as a prefix."""
    header = prompt_turns < len(messages) and messages[prompt_turns].get("role") == "assistant"
    try:
        prompt = tokenizer.apply_chat_template(messages[:prompt_turns], tools=tools, chat_template=template,
                                               tokenize=True, return_dict=True, add_generation_prompt=header)
    except Exception as e:  # noqa: BLE001 - template errors come as many types
        raise DataError(f"{where}: the chat template failed on this record's prompt: {type(e).__name__}: {e}") from e
    head = [int(i) for i in prompt["input_ids"]]
    if ids[:len(head)] != head:
        raise DataError(f"{where}: the chat template renders the prompt differently once the completion follows "
                        f"it, so the prompt's tokens cannot be told apart; write the record as 'messages' "
                        f"(every assistant turn trained) or with string prompt and completion")
    return len(head)
