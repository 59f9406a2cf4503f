"""The recipes of `bench throughput` (--recipes, --objective): what a step does besides forward and
backward, parsed from 'clip+accum4' and the like, and checked against the call's batches."""
from __future__ import annotations

from ...objectives.preference import OBJECTIVES


DEFAULT_CLIP = 1.0      # TrainConfig.max_grad_norm's default: the recipe users run


def parse_recipe(text: str) -> dict:
    """'clip+accum4' -> {"name": "clip+accum4", "max_grad_norm": 1.0, "grad_accum": 4, "objective": "sft"};
    a preference objective as a part ('clip+dpo': batches of pairs, the two-pass head)."""
    out = {"name": text.strip(), "max_grad_norm": None, "grad_accum": 1, "objective": "sft"}
    for part in (p.strip() for p in text.split("+")):
        if part == "plain":
            continue
        if part in OBJECTIVES[1:]:
            out["objective"] = part
            continue
        if part.startswith("clip"):
            out["max_grad_norm"] = float(part[4:]) if part[4:] else DEFAULT_CLIP
        elif part.startswith("accum") and part[5:].isdigit() and int(part[5:]) >= 1:
            out["grad_accum"] = int(part[5:])
        else:
            raise ValueError(f"unknown recipe part {part!r} in {text!r}: plain, clip[X], accumN, "
                             f"{'|'.join(OBJECTIVES[1:])}, joined by +")
    return out


def _check_recipes(recipes: list[dict], batches: list[int]) -> None:
    """Each batch splits into the recipe's micro-batches, each of whole pairs where it trains pairs."""
    for rec in recipes:
        if any(b % rec["grad_accum"] for b in batches):
            raise ValueError(f"recipe {rec['name']}: every batch must divide into {rec['grad_accum']} micro-batches")
        if rec["objective"] != "sft" and any((b // rec["grad_accum"]) % 2 for b in batches):
            raise ValueError(f"recipe {rec['name']}: a micro-batch holds whole pairs (2 rows each): every batch / "
                             f"{rec['grad_accum']} must be even")
