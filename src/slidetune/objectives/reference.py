"""The reference model's log-probabilities, computed once before training (issue 47; TRL's
`precompute_ref_log_probs`): no second model in memory.

DPO and IPO compare the policy's log-probability of each completion with the reference's, the
model as it was before preference tuning. At step 0 the policy *is* the reference, so the engine
that trains it computes them: a forward-only pass over every pair (`reference_logps`, each
sequence's completion tokens summed from the head's per-token losses, no logits kept), before the
first update. The result, [pairs, 2] FP32 (chosen, rejected), is cached as one safetensors file
(`cached_reference_logps`) keyed on what it depends on: the initial weights
(`WeightSource.fingerprint`), the pairs' token ids, the sequence cut, the compute dtype and this
format. A resumed run (its policy has moved on) reads the cache of the run it continues; a
second run on the same model and data skips the pass. The file is written to a temporary name
and renamed, with a digest of its values checked when read; one that fails is computed again.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..atomic_write import write_atomically
from ..data.preference import TokenizedPair, collate_pairs, pair_micro_batches
from .preference import PreferenceConfig, completion_sums

if TYPE_CHECKING:
    from ..parallel.ranks import Ranks

log = logging.getLogger(__name__)

REFERENCE_FORMAT = 1          # bump when what a cached value means changes


@dataclass
class PairScores:
    """Pairs scored by the engine's current weights (a forward each batch, no update)."""
    logps: torch.Tensor          # [pairs, 2] FP32: each side's completion log-probability sum (chosen, rejected)
    tokens: torch.Tensor         # [pairs, 2] int64: each side's completion tokens
    nll_sum: float               # the NLL term's tokens' summed CE (SimPO, ORPO; 0 for the others)
    nll_tokens: int


def _score_batch(engine, part: list[TokenizedPair], cfg: PreferenceConfig, pad_id: int,
                 max_length: int | None) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """One batch of B pairs through the engine's forward: each side's completion log-probability sum
    and completion tokens ([B, 2] each, (chosen, rejected)), the NLL term's summed CE and tokens."""
    (batch,) = pair_micro_batches(collate_pairs(part, pad_id, max_length, pad_to=max_length), cfg)
    rows = engine.token_losses(batch).float().cpu()                                      # [2B * S]
    sums, counts = completion_sums(rows, batch.pairs, 2 * len(part))                     # [2B] each
    return (torch.stack(sums.chunk(2), dim=1), torch.stack(counts.chunk(2), dim=1),
            float((rows.double() * batch.pairs.nll).sum()), int(batch.pairs.nll.sum()))


def score_pairs(engine, pairs: list[TokenizedPair], cfg: PreferenceConfig, pad_id: int, max_length: int | None,
                batch_pairs: int, ranks: "Ranks | None" = None) -> PairScores:
    """Every pair through the engine's forward, `batch_pairs` pairs a batch (2 x batch_pairs sequences
    padded to `max_length`, the training steps' shape), each token's loss summed into its sequence:
    the reference pass, and the held-out evaluation of a preference run.

    With several `ranks` (a collective: every rank calls it) rank r scores batches r, r + N, ...,
    and every rank gets every batch's scores (gathered): the same values on every rank, 1 / N of
    the forwards each. A rank left without a batch in the last round scores the first one again
    and drops it: every rank runs the same forwards, as a forward may issue collectives
    (dp_weights=gather's broadcasts) that must match across ranks."""
    world, rank = (ranks.world_size, ranks.rank) if ranks is not None else (1, 0)
    starts = list(range(0, len(pairs), batch_pairs))
    mine = starts[rank::world]
    scored = []
    for k in range(-(-len(starts) // world)):               # rounds: every rank the same count
        start = mine[k] if k < len(mine) else None
        first = start if start is not None else 0
        part = _score_batch(engine, pairs[first:first + batch_pairs], cfg, pad_id, max_length)
        if start is not None:
            scored.append((start, *part))
    if world > 1:
        scored = [s for each in ranks.gather(scored) for s in each]
    logps = torch.empty(len(pairs), 2, dtype=torch.float32)
    tokens = torch.empty(len(pairs), 2, dtype=torch.long)
    nll_sum, nll_tokens = 0.0, 0
    for start, batch_logps, batch_tokens, batch_nll, batch_nll_tokens in sorted(scored, key=lambda s: s[0]):
        logps[start:start + len(batch_logps)] = batch_logps                              # [B, 2]
        tokens[start:start + len(batch_logps)] = batch_tokens
        nll_sum += batch_nll                                 # in the batches' order, as one rank adds them
        nll_tokens += batch_nll_tokens
    return PairScores(logps, tokens, nll_sum, nll_tokens)


def reference_logps(engine, pairs: list[TokenizedPair], cfg: PreferenceConfig, pad_id: int,
                    max_length: int | None, batch_pairs: int, ranks: "Ranks | None" = None) -> torch.Tensor:
    """[len(pairs), 2] FP32: each pair's chosen and rejected completion log-probability sums with the
    engine's current weights, `batch_pairs` pairs a forward (2 x batch_pairs sequences; several
    ranks share the forwards: score_pairs)."""
    return score_pairs(engine, pairs, cfg, pad_id, max_length, batch_pairs, ranks).logps


def reference_key(model_fingerprint: str, pairs: list[TokenizedPair], max_length: int | None, dtype: str) -> str:
    """Hex key of what the reference's values depend on."""
    import xxhash
    h = xxhash.xxh3_128()
    h.update(f"{REFERENCE_FORMAT}\x00{max_length}\x00{dtype}\x00".encode())
    h.update(model_fingerprint.encode())
    for p in pairs:
        for ids in (p.prompt, p.chosen, p.rejected):
            h.update(len(ids).to_bytes(4, "little"))
            h.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


def _values_digest(values: torch.Tensor) -> str:
    import xxhash
    return xxhash.xxh3_128(values.contiguous().numpy().tobytes()).hexdigest()


def _read(file: Path, key: str, count: int) -> torch.Tensor | None:
    """The cached values, or None (and why, logged) where the file is absent or does not check out."""
    if not file.exists():
        return None
    from safetensors import safe_open
    try:
        with safe_open(str(file), "pt") as f:
            meta = f.metadata() or {}
            values = f.get_tensor("reference_logps")
    except Exception as e:  # noqa: BLE001 - a cut or overwritten file raises many types; each means: compute again
        log.warning("%s: unreadable (%s: %s); computing the reference log-probabilities again", file, type(e).__name__, e)
        return None
    if meta.get("key") != key or tuple(values.shape) != (count, 2) or meta.get("digest") != _values_digest(values):
        log.warning("%s: does not match its key, the pairs or its digest; computing the reference "
                    "log-probabilities again", file)
        return None
    return values


@dataclass
class Reference:
    """The reference's sums of a run's pairs, and where they came from."""
    logps: torch.Tensor          # [pairs, 2] FP32 (chosen, rejected)
    file: Path | None            # the cache file (None: no cache)
    read: bool                   # read from the cache (False: computed by the engine)


def cached_reference_logps(engine, pairs: list[TokenizedPair], cfg: PreferenceConfig, pad_id: int,
                           max_length: int | None, batch_pairs: int, cache_dir: Path | None,
                           model_fingerprint: str, dtype: str, ranks: "Ranks | None" = None) -> Reference:
    """reference_logps, read from `cache_dir` where an earlier run (or the run this one resumes) left
    them for the same weights, pairs, cut and dtype; else computed and written there (None: no
    cache, always computed).

    Several `ranks` (a collective): rank 0 reads the cache and every rank gets its answer, so the
    ranks agree on whether to compute (a rank reading a file another has just written would skip
    forwards the others run); if not, they share the forwards (score_pairs) and rank 0 alone writes."""
    key = reference_key(model_fingerprint, pairs, max_length, dtype)
    file = cache_dir / f"reference-logps-{key}.safetensors" if cache_dir is not None else None
    on_main = ranks.on_main if ranks is not None else (lambda fn: fn())
    if file is not None:
        values = on_main(lambda: _read(file, key, len(pairs)))
        if values is not None:
            log.info("reference log-probabilities of %d pairs read from %s", len(pairs), file)
            return Reference(values, file, read=True)
    values = reference_logps(engine, pairs, cfg, pad_id, max_length, batch_pairs, ranks)
    if file is not None:
        on_main(lambda: _write(file, key, values, dtype))
    return Reference(values, file, read=False)


def _write(file: Path, key: str, values: torch.Tensor, dtype: str) -> None:
    from safetensors.torch import save_file
    file.parent.mkdir(parents=True, exist_ok=True)
    meta = {"key": key, "digest": _values_digest(values), "pairs": str(len(values)), "dtype": dtype}
    write_atomically(file, lambda tmp: save_file({"reference_logps": values}, str(tmp), metadata=meta))
