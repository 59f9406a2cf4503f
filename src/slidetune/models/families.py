"""Every causal-LM family of transformers 5.17, by `config.model_type`: tested or refused.

`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` lists 178 model types. Each is in exactly one of:

- `TESTED`: decoder-only families whose split agrees with transformers' own forward and
  backward (loss and every gradient, fp32, relative 1e-4) on a tiny config, in
  `tests/test_families.py::test_family_split_matches_transformers`;
- `REFUSED`: decoder-only families slidetune does not train, with the reason;
- `NOT_DECODER_ONLY`: encoder-decoder halves, encoders usable as decoders and multimodal
  composite configs, with the reason (and, for the composites, the text family to use).

`require_supported_family` runs at load (from `load.skeleton`): a refused family gets
its reason at once instead of a failure deep in the split. A family not listed here
(remote code, a newer transformers) is not refused by name: the reference self-check
(`reference_check.py`) is its guard. Mixture-of-experts families train the loss
transformers trains: cross-entropy only unless `output_router_logits` is set, when
transformers adds the router's auxiliary loss; that case is refused (not implemented).
"""
from __future__ import annotations

from transformers import PretrainedConfig

from .units import UnsupportedModelError


class UnsupportedFamilyError(UnsupportedModelError):
    pass


# Decoder-only families checked against transformers in tests/test_families.py. MoE ones
# are marked: sliding one of their layers moves every expert (see `plan`).
TESTED_DENSE = (
    "apertus_never",  # placeholder removed below
)
