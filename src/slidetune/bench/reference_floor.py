"""The floor of a preference run's reference pass (issue 47): the forward-only slide over every pair
that DPO and IPO run once before step 1 (objectives/reference.py), from the same probes as a
training step's floor (bench.roofline). `slidetune plan --terms --objective dpo` prints it.

A batch of the pass is a training micro-batch's shape (--batch-size pairs, 2 rows each) through
every layer's forward and the head's first pass, no backward and no update: its compute is each
layer's probed forward plus a third of the head's probed forward and backward (the backward's two
GEMMs are skipped), and its PCIe is one upload of every host-updated unit's BF16 weights (a
training step's window uploads most layers twice). No gradients come down and no AdamW runs.
"""
from __future__ import annotations

from ..engine.placement import PlacementPlan


def reference_pass_terms(comp: dict, copy: dict, plan: PlacementPlan) -> dict[str, float]:
    """{compute_s, h2d_s} of one batch of the reference pass (seconds, at the probed rates)."""
    gib = 2**30
    compute = len(plan.layers) * comp["layer_forward_s"] + comp["head_s"] / 3 + comp.get("embed_s", 0.0) / 3
    return {"compute_s": compute, "h2d_s": 2 * plan.host_updated_params / (copy["h2d_gib_s"] * gib)}
