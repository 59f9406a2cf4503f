"""Tokenized examples kept between runs, so that a second run on the same data does not tokenize again.

The key is a hash of everything the tokens depend on: the examples' content (each segment's text and
whether it is supervised, or a conversation's messages), the tokenizer (`tokenizer_fingerprint`: its
vocabulary, merges, normalizer, special tokens and chat template), ``mask_prompt``, and the versions
of transformers/tokenizers and of this format. Not the path: a copied file hits, an edited one does
not. The entry is one ``.npz`` (ids int32, targets bool, lengths int64, and digest: an xxh3-128 of
the three arrays), written to a temporary name and renamed (atomic_write.py), so an interrupted
run leaves no half entry. A cache is only a cache: an entry that cannot be read (flipped bytes fail
the zip's CRC, a cut file is no zip), lacks an array or whose arrays do not match its digest is
deleted with a note and the data tokenized again, and the entry written anew.

Data under `CACHE_MIN_CHARS` is tokenized again each run: that takes well under a second, less than
a cache file's write, read and place on disk.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic_write import write_atomically
from ..models.hub import datasets_cache_dir
from .formats import Example
from .tokenization import TokenizedExample, tokenize_examples

log = logging.getLogger(__name__)

# bump when tokenization.py's rules (BOS/EOS/targets) change: older entries no longer match
CACHE_FORMAT = 1
# ~4M characters are ~1M tokens: a few seconds of tokenizing on 2 cores, where a cache starts paying
CACHE_MIN_CHARS = 4 * 2**20


def cache_root(cache_dir: str | None) -> Path | None:
    """DataConfig.cache_dir -> the directory of entries, or None when caching is "off"."""
    if cache_dir is not None and cache_dir.strip().lower() == "off":
        return None
    return Path(cache_dir).expanduser() if cache_dir else datasets_cache_dir() / "slidetune"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A string that changes when the tokenizer's output could: a fast tokenizer's full serialization
    (vocabulary, merges, normalizer, added tokens), else datasets' hash of the object; plus the
    special tokens and chat template the rules read."""
    import tokenizers
    import transformers
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        body = backend.to_str()
    else:
        from datasets.fingerprint import Hasher
        body = Hasher.hash(tokenizer)
    parts = [type(tokenizer).__name__, body, repr(getattr(tokenizer, "chat_template", None)),
             repr(getattr(tokenizer, "bos_token_id", None)), repr(getattr(tokenizer, "eos_token_id", None)),
             repr(getattr(tokenizer, "eos_token", None)), transformers.__version__, tokenizers.__version__]
    return "\x00".join(parts)


def examples_key(examples: list[Example], tokenizer_fp: str, mask_prompt: bool) -> tuple[str, int]:
    """(hex key of the examples' tokens, their characters of text)."""
    import xxhash
    h = xxhash.xxh3_128()
    h.update(f"{CACHE_FORMAT}\x00{mask_prompt}\x00".encode())
    h.update(tokenizer_fp.encode("utf-8", "surrogatepass"))
    chars = 0
    for ex in examples:
        if ex.messages is not None:       # a record's tool schemas render into its prompt
            # (a conversational prompt-completion's prompt turns change the targets, not the text)
            text = json.dumps([ex.messages, ex.tools] + ([ex.prompt_turns] if ex.prompt_turns else []),
                              sort_keys=True, ensure_ascii=False)
            h.update(b"\x01m" + text.encode("utf-8", "surrogatepass"))
            chars += len(text)
        else:
            for seg in ex.segments or ():
                h.update(b"\x01s1" if seg.supervised else b"\x01s0")
                h.update(seg.text.encode("utf-8", "surrogatepass"))
                chars += len(seg.text)
        h.update(b"\x02")
    return h.hexdigest(), chars


def _text_chars(examples: list[Example]) -> int:
    """Characters of text (a conversation's contents), counted before anything is hashed."""
    return sum(sum(len(m.get("content") or "") for m in ex.messages) if ex.messages is not None
               else sum(len(seg.text) for seg in ex.segments or ()) for ex in examples)


def _digest(ids: np.ndarray, targets: np.ndarray, lengths: np.ndarray) -> str:
    """xxh3-128 of the entry's arrays (dtype and size before each, so bytes cannot shift between them)."""
    import xxhash
    h = xxhash.xxh3_128()
    for a in (ids, targets, lengths):
        h.update(f"{a.dtype.str}:{a.size}\x00".encode())
        h.update(np.ascontiguousarray(a))
    return h.hexdigest()


def _read(file: Path) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray] | None, str]:
    """((ids, targets, lengths), "") of an entry that checks out, else (None, what is wrong)."""
    try:
        with np.load(file) as z:
            if "digest" not in z.files:
                return None, "it has no digest (an older slidetune wrote it)"
            ids, targets, lengths, digest = z["ids"], z["targets"], z["lengths"], str(z["digest"])
    # numpy and zipfile raise many types here: BadZipFile (a bad CRC, a cut file), EOFError, a
    # ValueError for a pickle, KeyError for a missing array, zlib.error; each means the same
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}"
    if _digest(ids, targets, lengths) != digest:
        return None, "its arrays do not match the digest stored with them"
    return (ids, targets, lengths), ""


def discard_entry(files: tuple[Path, ...], message: str) -> None:
    """Delete a cache entry's files that do not check out, in order, with a note: the next run must
    not meet them again, whatever happens now (this one and the streamed cache's entries)."""
    log.info("%s", message)
    print(f"note: {message}", file=sys.stderr)
    for path in files:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass                             # rewritten by the rebuild if the directory allows, else read-only: no harm


def _load(file: Path, examples: list[Example]) -> list[TokenizedExample] | None:
    """The cached tokens of `examples`, or None after deleting an entry that does not check out
    (with a note: damage, or an older slidetune's entry without a digest)."""
    arrays, problem = _read(file)
    if arrays is not None and len(arrays[2]) != len(examples):
        arrays, problem = None, f"it holds {len(arrays[2])} examples' tokens, not {len(examples)}"
    if arrays is None:
        discard_entry((file,), f"token cache entry {file} discarded ({problem}): tokenizing again")
        return None
    ids, targets, lengths = arrays
    ends = np.cumsum(lengths)
    out = []
    for ex, end, n in zip(examples, ends.tolist(), lengths.tolist()):
        out.append(TokenizedExample(ids[end - n:end].tolist(), targets[end - n:end].tolist(), ex.where))
    return out


def _save(file: Path, tokenized: list[TokenizedExample]) -> None:
    """Write the entry under a temporary name of this process and rename it over `file`."""
    file.parent.mkdir(parents=True, exist_ok=True)
    ids = np.fromiter((t for e in tokenized for t in e.ids), dtype=np.int64)
    ids = ids.astype(np.int32 if ids.size == 0 or ids.max() < 2**31 else np.int64)
    targets = np.fromiter((t for e in tokenized for t in e.targets), dtype=bool)
    lengths = np.array([len(e.ids) for e in tokenized], dtype=np.int64)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:          # a file object: np.savez would add ".npz" to a name
            np.savez(f, ids=ids, targets=targets, lengths=lengths, digest=np.array(_digest(ids, targets, lengths)))

    # the pid in the temporary name: two runs writing the same entry each rename a whole file
    write_atomically(file, write, tmp=file.with_name(f"{file.stem}.{os.getpid()}.tmp.npz"))


def tokenize_cached(examples: list[Example], tokenizer: Any, mask_prompt: bool, source_name: str,
                    cache_dir: str | None, chat_template: str | None = None) -> list[TokenizedExample]:
    """`tokenization.tokenize_examples`, read from the cache when these examples were tokenized the
    same way before (and written there otherwise). A cache that cannot be written only warns.
    chat_template: --chat-template's Jinja text (None: the tokenizer's), part of the key."""
    root = cache_root(cache_dir)
    if root is None or not examples:
        return tokenize_examples(examples, tokenizer, mask_prompt, source_name, chat_template)
    if _text_chars(examples) < CACHE_MIN_CHARS:
        return tokenize_examples(examples, tokenizer, mask_prompt, source_name, chat_template)
    key, _ = examples_key(examples, tokenizer_fingerprint(tokenizer) + f"\x00{chat_template or ''}", mask_prompt)
    file = root / f"tokens-{key}.npz"
    if file.is_file():
        cached = _load(file, examples)
        if cached is not None:
            log.info("%s: %d examples' tokens read from the cache %s", source_name, len(examples), file)
            return cached
    tokenized = tokenize_examples(examples, tokenizer, mask_prompt, source_name, chat_template)
    try:
        _save(file, tokenized)
    except OSError as e:
        log.warning("token cache %s not written (%s): the next run tokenizes again", file, e)
    return tokenized
