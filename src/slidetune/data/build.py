"""`build_datasets`: config + tokenizer -> (train, held-out) `TokenDataset`s.

Pipeline: read the source (formats.py, hf_datasets.py) -> held-out split over examples (split.py),
or --eval-data as the held-out set -> tokenize each split (tokenization.py; kept between runs by
token_cache.py) -> pack or pad (packing.py) -> check non-empty. A streamed source goes to a token
file instead (streaming.py) and trains memory-mapped, as a pre-tokenized corpus does.

Small data sets (a few dozen short examples, a usual first try) train rather than being
refused; each fallback prints a ``note:`` line to stderr:

* fewer than `split.MIN_HELDOUT_EXAMPLES` (10) examples: no held-out split (all of them train);
* packing the training examples gives fewer rows than one batch (``min_rows``, e.g. none of
  seq_len+1 tokens): one example per row instead, right-padded to seq_len (the padding is
  masked out of attention and loss, batch.py), and the held-out split is padded too;
* packing the held-out examples gives no row: they are evaluated one example per row;
* no held-out row has a target token: training goes on without the held-out evaluation.

What cannot train raises `DataError` saying why and what to do: no example with a token to
train on within seq_len+1 tokens, or fewer usable rows than one batch.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import warnings
from typing import Any

from .config import DataConfig
from .corpus import builtin_corpus
from .dataset import TokenDataset
from .errors import DataError
from .chat_template import load_chat_template
from .formats import Example, Source, texts_source
from .hf_datasets import (StreamingSource, in_memory_source, is_iterable_dataset, iterable_source, open_streaming,
                          should_stream)
from .mixture import MixedSource, parse_mixture
from .packing import Rows, fill_ratio, pack, pack_whole, pad_rows
from .sources import read_source
from .split import MIN_HELDOUT_EXAMPLES, plan_heldout
from .streaming import build_streaming
from .token_arrays import TokenArrayDataset, build_token_datasets, is_token_source
from .token_cache import tokenize_cached
from .tokenization import TokenizedExample, special_ids

log = logging.getLogger(__name__)

BUILTIN_NAME = "<builtin corpus>"


def load_source(cfg: DataConfig, records=None, eval_records=None) -> Source | StreamingSource | MixedSource:
    """The untokenized examples of ``cfg.path`` (or of the built-in corpus), with those of
    ``cfg.eval_path`` as ``eval_source``; a `StreamingSource` (its first record read) when streamed.
    ``records`` / ``eval_records``: a `datasets.Dataset` or a list of record dicts given in Python
    (hf_datasets.in_memory_source) instead of ``cfg.path`` / ``cfg.eval_path``; a `datasets.IterableDataset`
    as ``records`` is streamed (hf_datasets.iterable_source), as ``eval_records`` read whole."""
    mixture = parse_mixture(cfg.path)
    if mixture is not None:
        return _load_mixture(cfg, mixture, records is not None or eval_records is not None)
    source: Source | StreamingSource
    given = [k for k, v in (("path", records), ("eval_path", eval_records)) if v is not None and getattr(cfg, k)]
    if given:
        raise DataError(f"the data is given twice: data.{given[0]} is {getattr(cfg, given[0])!r} and a dataset is "
                        f"passed in Python too; give one of them")
    if records is not None and is_iterable_dataset(records):
        source = iterable_source(records, cfg.column_map)       # streamed: the token file in the cache
    elif records is not None:
        source = in_memory_source(records, cfg.column_map)
    elif cfg.path is None:
        source = texts_source(builtin_corpus(), BUILTIN_NAME)
    elif should_stream(cfg.path, cfg.streaming):
        source = open_streaming(cfg.path, cfg.split, cfg.subset, cfg.column_map)
    else:
        source = read_source(cfg.path, cfg.split, cfg.subset, columns=cfg.column_map)
    if eval_records is not None:
        source.eval_source = in_memory_source(eval_records, cfg.column_map)
    elif cfg.eval_path is not None:
        source.eval_source = load_eval_source(cfg)
    return source


def _load_mixture(cfg: DataConfig, mixture: list[tuple[str, float]], in_python: bool) -> MixedSource:
    """The sources of `--data a.jsonl:0.7,b/:0.3`, each read as --data alone would read it (into RAM:
    a pre-tokenized corpus and a streamed source are refused in a mixture, as is --eval-data)."""
    why = ("a dataset given in Python as well" if in_python else
           "--eval-data: each source holds out its own share (--heldout-fraction)" if cfg.eval_path else None)
    if why:
        raise DataError(f"--data {cfg.path!r} mixes sources, and {why}; give one or the other")
    sources = []
    for path, _ in mixture:
        if is_token_source(path) or should_stream(path, cfg.streaming):
            raise DataError(f"--data {cfg.path!r}: {path} is {'pre-tokenized' if is_token_source(path) else 'streamed'}; "
                            f"a mixture reads records into RAM (--data-streaming off, or train on it alone)")
        one = load_source(dataclasses.replace(cfg, path=path))
        assert isinstance(one, Source)
        sources.append(one)
    return MixedSource(cfg.path, sources, [w for _, w in mixture])


def load_eval_source(cfg: DataConfig) -> Source:
    """The examples of --eval-data (read whole: an evaluation set is read every evaluation)."""
    assert cfg.eval_path is not None
    if is_token_source(cfg.eval_path):
        raise DataError(f"{cfg.eval_path}: --eval-data takes text or records to tokenize, not a pre-tokenized "
                        f"corpus; hold out the tail of the training corpus with --heldout-fraction instead")
    return read_source(cfg.eval_path, subset=cfg.subset, for_eval=True, columns=cfg.column_map)


def _note(message: str) -> None:
    """A fallback the user should know about: printed (not a warning: nothing is wrong)."""
    log.info("%s", message)
    print(f"note: {message}", file=sys.stderr)


def _n_tokens(examples: list[TokenizedExample]) -> int:
    return sum(len(e.ids) for e in examples)


def _warn_rows(rows: Rows, name: str, n_examples: int, source: Source, cfg: DataConfig) -> None:
    if rows.num_truncated:
        warnings.warn(f"{source.name}: {rows.num_truncated} of {n_examples} {name} examples are "
                      f"longer than seq_len+1 = {cfg.seq_len + 1} tokens and were truncated (their "
                      f"ends, EOS included, are not trained on)", stacklevel=4)
    if rows.num_dropped and rows.starts.numel():
        warnings.warn(f"{source.name}: {rows.num_dropped} {name} rows have no target token "
                      f"(e.g. a prompt longer than seq_len) and were dropped", stacklevel=4)


def _no_usable_examples(tokenized: list[TokenizedExample], n_heldout: int, source: Source,
                        cfg: DataConfig) -> DataError:
    """The error for a train split without one row to train on (padded: one row per example)."""
    width = cfg.seq_len + 1
    none_at_all = sum(not any(e.targets[1:]) for e in tokenized)
    beyond = sum(any(e.targets[1:]) and not any(e.targets[1:width]) for e in tokenized)
    causes = []
    if none_at_all:
        causes.append(f"{none_at_all} {'has' if none_at_all == 1 else 'have'} no token to train "
                      f"on at all (an empty text or completion, or a conversation without an "
                      f"assistant reply)")
    if beyond:
        causes.append(f"{beyond} {'has' if beyond == 1 else 'have'} none within the first "
                      f"seq_len+1 = {width} tokens (a prompt of seq_len = {cfg.seq_len} tokens or "
                      f"more)")
    hints = ["add examples with something to train on"]
    if beyond:
        hints.append("use a larger --seq-len (up to the model's context) or shorter prompts")
    hints.append("check the data's format (prompt/completion and instruction/output records train "
                 "on the completion/output, chat records on the assistant turns, text records on "
                 "the text)")
    n = len(tokenized)
    return DataError(
        f"{source.name}: no usable training examples (the train split is empty after "
        f"tokenization): "
        f"of the {n} training example{'' if n == 1 else 's'} ({_n_tokens(tokenized)} tokens"
        + (f"; {n_heldout} more held out" if n_heldout else "") + "), "
        + " and ".join(causes) + "; " + ", ".join(hints[:-1]) + " or " + hints[-1])


def _too_few_rows(rows: Rows, padded: bool, n_packed: int, n_examples: int, n_heldout: int,
                  min_rows: int, source: Source, cfg: DataConfig) -> DataError:
    """The error for a train split with fewer rows than one batch."""
    width = cfg.seq_len + 1
    if padded:
        what = f"{len(rows.starts)} usable rows of one example each"
        hints = ["add examples", "use a smaller --batch-size"]
    else:
        what = f"{n_packed} packed rows of seq_len+1 = {width} tokens"
        hints = ["add data", "use a smaller --seq-len", "use a smaller --batch-size"]
    if n_heldout:
        hints.append(f"train on the {n_heldout} held-out examples too (--heldout-fraction 0)")
    return DataError(f"{source.name}: too little training data for one batch: the {n_examples} "
                     f"training examples give {what}, fewer than batch_size={min_rows}; "
                     + ", ".join(hints[:-1]) + " or " + hints[-1])


def _packer(cfg: DataConfig, source: Source):
    """pack_whole (bfd: whole examples) or pack (wrapped: windows), as cfg.packing_strategy says."""
    return pack_whole if cfg.packs_whole_examples(source.format) else pack


def _template_of(cfg: DataConfig, source: Source) -> str | None:
    """--chat-template's Jinja text for a chat source (None: the tokenizer's own, or not chat)."""
    return load_chat_template(cfg.chat_template) if source.format == "chat" else None


def _build_train(examples: list[Example], n_heldout: int, source: Source, cfg: DataConfig,
                 tokenizer: Any, min_rows: int, notes: list[str], template: str | None) -> TokenDataset:
    tokenized = tokenize_cached(examples, tokenizer, cfg.mask_prompt, source.name, cfg.cache_dir, template)
    width = cfg.seq_len + 1
    padded, n_packed, note = not cfg.packed, 0, None
    if cfg.packed:
        rows = _packer(cfg, source)(tokenized, cfg.seq_len)
        n_packed = len(rows.starts)
        if n_packed < min_rows:
            per_example = pad_rows(tokenized, cfg.seq_len)
            if len(per_example.starts) > n_packed:
                filled = (f"fill only {n_packed} packed row(s) of seq_len+1 = {width} tokens, "
                          f"fewer than one batch (batch_size={min_rows})" if n_packed else
                          f"are too few to fill one packed row of seq_len+1 = {width} tokens")
                note = (f"{source.name}: the {len(examples)} training examples "
                        f"({_n_tokens(tokenized)} tokens) {filled}: training on one example per "
                        f"row instead, right-padded to seq_len (padding is masked out of attention "
                        f"and loss)" + (", and the held-out examples are evaluated the same way"
                                    if n_heldout else ""))
                rows, padded = per_example, True
    else:
        rows = pad_rows(tokenized, cfg.seq_len)
    if len(rows.starts) == 0:
        # padded rows are one per example (computed above whenever packing gave none)
        raise _no_usable_examples(tokenized, n_heldout, source, cfg)
    if len(rows.starts) < min_rows:
        raise _too_few_rows(rows, padded, n_packed, len(examples), n_heldout, min_rows, source, cfg)
    if note:
        notes.append(note)
    if not padded and cfg.packs_whole_examples(source.format):
        notes.append(f"{source.name}: the {len(examples)} training examples are packed whole into "
                     f"{len(rows.starts)} rows of up to seq_len+1 = {width} tokens (best-fit decreasing, "
                     f"--packing-strategy bfd): {100 * fill_ratio(rows, cfg.seq_len):.1f}% of the row "
                     f"tokens are real, the rest is padding (masked out of the loss)")
    _warn_rows(rows, "train", len(examples), source, cfg)
    return TokenDataset.from_rows(rows, cfg.seq_len, not padded, split="train", source=source.name,
                                  document_mask=cfg.packing == "masked" and not padded,
                                  format=source.format, num_examples=len(examples))


def _build_heldout(examples: list[Example], padded: bool, source: Source, cfg: DataConfig,
                   tokenizer: Any, notes: list[str], template: str | None) -> TokenDataset:
    """The held-out rows: packed like the train split unless that gives no row; empty (with a
    note) when not one held-out example has a token to evaluate."""
    info = dict(split="heldout", source=source.name, format=source.format)
    tokenized = tokenize_cached(examples, tokenizer, cfg.mask_prompt, source.name, cfg.cache_dir, template)
    width = cfg.seq_len + 1
    if padded:
        rows = pad_rows(tokenized, cfg.seq_len)
    else:
        rows = _packer(cfg, source)(tokenized, cfg.seq_len)
        if len(rows.starts) == 0:
            rows, padded = pad_rows(tokenized, cfg.seq_len), True
            if len(rows.starts):
                notes.append(f"{source.name}: the {len(examples)} held-out examples "
                             f"({_n_tokens(tokenized)} tokens) are too few to fill one packed row "
                             f"of seq_len+1 = {width} tokens: they are evaluated one example per "
                             f"row, right-padded")
    if len(rows.starts) == 0:
        notes.append(f"{source.name}: none of the {len(examples)} held-out examples has a token to "
                     f"evaluate within seq_len+1 = {width} tokens: training without a held-out "
                     f"evaluation")
        return TokenDataset.empty(cfg.seq_len, cfg.packed, num_examples=len(examples), **info)
    _warn_rows(rows, "heldout", len(examples), source, cfg)
    return TokenDataset.from_rows(rows, cfg.seq_len, not padded, num_examples=len(examples),
                                  document_mask=cfg.packing == "masked" and not padded, **info)


def _build_eval(evaluation: Source, cfg: DataConfig, tokenizer: Any, vocab_size: int | None) -> TokenDataset:
    """--eval-data's rows next to a memory-mapped train split (packed, unless too few for a row)."""
    if tokenizer is None:
        raise DataError(f"{evaluation.name}: --eval-data is tokenized, and the model has no tokenizer")
    notes: list[str] = []
    heldout = _build_heldout(evaluation.examples, False, evaluation, cfg, tokenizer, notes,
                             _template_of(cfg, evaluation))
    if vocab_size is not None:
        _check_tokenizer_ids((heldout,), vocab_size, evaluation)
    for note in notes:
        _note(note)
    return heldout


def _build_streamed(source: StreamingSource, cfg: DataConfig, tokenizer: Any, min_rows: int,
                    vocab_size: int | None) -> tuple[TokenArrayDataset, TokenArrayDataset | TokenDataset]:
    """A streamed source: tokenized a chunk at a time into a memory-mapped token file (streaming.py)."""
    train, heldout = build_streaming(source, cfg, tokenizer, min_rows, vocab_size)
    evaluation = source.eval_source
    if evaluation is not None:
        return train, _build_eval(evaluation, cfg, tokenizer, vocab_size)
    log.info("data: %r; %r", train, heldout)
    return train, heldout


def _build_token_arrays(cfg: DataConfig, tokenizer: Any, min_rows: int,
                        vocab_size: int | None) -> tuple[TokenArrayDataset, TokenArrayDataset | TokenDataset]:
    """A pre-tokenized corpus: memory-mapped windows, no tokenization (token_arrays.py)."""
    assert cfg.path is not None
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    evaluation = load_eval_source(cfg) if cfg.eval_path is not None else None
    train, heldout = build_token_datasets(cfg.path, cfg.seq_len, cfg.token_dtype,
                                          0.0 if evaluation is not None else cfg.heldout_fraction,
                                          eos_id=eos, document_mask=cfg.packing == "masked",
                                          min_rows=min_rows, vocab_size=vocab_size)
    if evaluation is not None:
        return train, _build_eval(evaluation, cfg, tokenizer, vocab_size)
    if cfg.packing == "off":
        _note(f"{cfg.path}: a pre-tokenized corpus is always packed (its documents are not stored "
              f"apart); --packing off has no effect, masked keeps documents apart, causal does not")
    if cfg.heldout_fraction > 0 and len(heldout) == 0:
        _note(f"{cfg.path}: {len(train)} rows are too few to hold some out (that takes at least "
              f"{MIN_HELDOUT_EXAMPLES}): training without a held-out evaluation")
    log.info("data: %r; %r", train, heldout)
    return train, heldout


def build_datasets(cfg: DataConfig, tokenizer: Any, min_rows: int = 1, vocab_size: int | None = None,
                   source: Source | StreamingSource | None = None) -> tuple[TokenDataset | TokenArrayDataset,
                                                         TokenDataset | TokenArrayDataset]:
    """(train, heldout) for ``cfg``. The held-out split is empty when heldout_fraction == 0, when
    there are fewer than `split.MIN_HELDOUT_EXAMPLES` examples, or when no held-out example has a
    token to evaluate (both with a note).

    ``min_rows``: the train split must have at least this many rows (the trainer passes its
    batch_size); packed rows fewer than that fall back to one example per row (see the module
    docstring). The notes are printed once both splits are built (an error comes alone).
    A pre-tokenized corpus (.bin/.npy, or a save_to_disk directory of input_ids) gives
    memory-mapped `TokenArrayDataset`s instead (token_arrays.py), as does a streamed source
    (streaming.py). With ``cfg.eval_path`` the held-out split is that evaluation set, and all of
    ``cfg.path`` trains. With ``vocab_size`` (the
    model's) every token id, the tokenizer's or the corpus's, is checked to be below it.
    ``source``: the examples of ``cfg`` already read (load_source: train reads them before it loads
    the model, so bad data is refused in seconds); None reads them here.
    Raises `DataError` (naming the file and 1-based line or row where it applies) for missing,
    malformed or too little data, and for a Hub id that is not cached and cannot be downloaded.
    """
    if min_rows < 1:
        raise ValueError(f"min_rows must be >= 1, got {min_rows}")
    if is_token_source(cfg.path):
        return _build_token_arrays(cfg, tokenizer, min_rows, vocab_size)
    source = source if source is not None else load_source(cfg)
    if isinstance(source, MixedSource):
        return _build_mixture(source, cfg, tokenizer, vocab_size)
    if isinstance(source, StreamingSource):
        return _build_streamed(source, cfg, tokenizer, min_rows, vocab_size)
    special_ids(tokenizer, source.name)  # fail on a tokenizer without EOS before any work
    template = _template_of(cfg, source)
    evaluation = source.eval_source
    if evaluation is not None:       # --eval-data: evaluated instead of a held-out split; all of it trains
        train_idx, heldout_idx, note = list(range(len(source.examples))), [], None
    else:
        train_idx, heldout_idx, note = plan_heldout(len(source.examples), cfg.heldout_fraction,
                                                    cfg.seed, source.name)
    notes = [note] if note else []
    train = _build_train([source.examples[i] for i in train_idx], len(heldout_idx), source, cfg,
                         tokenizer, min_rows, notes, template)
    if evaluation is not None:
        heldout = _build_heldout(evaluation.examples, not train.packed, evaluation, cfg, tokenizer, notes,
                                 _template_of(cfg, evaluation))
    elif heldout_idx:
        heldout = _build_heldout([source.examples[i] for i in heldout_idx], not train.packed,
                                 source, cfg, tokenizer, notes, template)
    else:
        heldout = TokenDataset.empty(cfg.seq_len, cfg.packed, split="heldout",
                                     source=source.name, format=source.format)
    if vocab_size is not None:
        _check_tokenizer_ids((train, heldout), vocab_size, source)
    for note in notes:
        _note(note)
    log.info("data: %r; %r", train, heldout)
    return train, heldout


def _build_mixture(mixed: MixedSource, cfg: DataConfig, tokenizer: Any, vocab_size: int | None
                   ) -> tuple[TokenDataset, TokenDataset]:
    """(train, heldout) of a mixture: each source built as it would be alone (its held-out share
    its own), the train rows one dataset whose `parts` carry the weights (sampler.py draws by them),
    the held-out rows one split."""
    trains, helds = [], []
    for part in mixed.sources:
        train, heldout = build_datasets(dataclasses.replace(cfg, path=part.name), tokenizer, vocab_size=vocab_size,
                                        source=part)
        if not len(train):
            raise DataError(f"--data {mixed.name!r}: {part.name} leaves no training row (all of it held out or "
                            f"dropped); give it more data or leave it out of the mixture")
        trains.append(train)
        helds += [heldout] if len(heldout) else []
    try:
        train = TokenDataset.concat(trains, mixed.weights, split="train", source=mixed.name, format=mixed.format)
        heldout = (TokenDataset.concat(helds, split="heldout", source=mixed.name, format=mixed.format) if helds
                   else TokenDataset.empty(cfg.seq_len, train.packed, split="heldout", source=mixed.name,
                                           format=mixed.format))
    except ValueError as e:     # one source too small to pack beside packed ones
        raise DataError(f"--data {mixed.name!r}: the sources cannot share batches: {e}; add data to the small one "
                        f"or --packing off") from None
    log.info("data: %r; %r", train, heldout)
    return train, heldout


def _check_tokenizer_ids(splits: tuple[TokenDataset, ...], vocab_size: int, source: Source) -> None:
    """A tokenizer with tokens added past the model's embedding (a special token added without
    resizing the embeddings) gives ids the model has no row for: an IndexError when a batch first
    holds one. The splits' tokens are in RAM: one max each."""
    top = max((int(ds.tokens.max()) for ds in splits if ds.tokens.numel()), default=-1)
    if top >= vocab_size:
        raise DataError(f"{source.name}: the tokenizer gives token id {top}, beyond the model's vocabulary of "
                        f"{vocab_size} ids (0..{vocab_size - 1}): it has tokens the model's embedding has no row "
                        f"for; use the model's own tokenizer, or resize the model's embeddings to the tokenizer")
