"""Will it fit? Host RAM, pinned memory and GPU memory of a configuration, before allocating.

    est = estimate_memory(split, rt, batch_size=16, seq_len=1024)    # itemized bytes
    check_fit(split, rt, batch_size=16, seq_len=1024)                 # or InsufficientMemoryError

The estimate is arithmetic over the skeleton's shapes (no tensor is allocated), so
it runs in milliseconds for any model size, including on a machine without a GPU
(`rt.device="cuda"` plans for one). When a configuration does not fit, the error
lists changes that DO fit, each found by re-running the same estimate (a smaller
batch found by bisection, offloaded checkpoints, fewer slots, a smaller head chunk,
another mode).

One concern a module, each importing only those above it:
  byte_models.py  what one layer (HF's or the lean one), the head and a gradient sum hold at their peak
  estimate.py     estimate_memory: the GPU, host, pinned and disk bytes of a configuration, item by item
  budget.py       the GPU's free memory and the host's RAM an estimate is checked against (FIT_SAFETY)
  choice.py       the choice by predicted time among the placements that fit, and what `plan` says of the others
  search.py       choose_auto_settings: the memory-dependent auto settings, resolved against the budget, the
                  fastest placement that fits by the step model (bench/step_model.py)
  suggestions.py  where a run does not fit: the changes that would, the disk tier's note, the message
  check.py        check_fit (InsufficientMemoryError), and both steps on every data-parallel rank
This package re-exports their public names: `from slidetune.engine.fit import check_fit`.
"""
from .budget import (ENV_HOST_MEMORY, FIT_SAFETY, Budget, budget_for, free_memory_needed, query_gpu_free_bytes,
                     query_host_available_bytes)
from .byte_models import (ACTIVATION_MARGIN, HEAD_MARGIN, GiB, MiB, fit_counts_compiled, head_bytes,
                          layer_activation_bytes,
                          lean_layer_bytes, lean_row_tiled_bytes, materialized_masks, summing_bytes,
                          working_set_bytes)
from .check import (InsufficientMemoryError, Workload, check_fit, check_fit_on_ranks, place_on_ranks,
                    shared_state_bytes)
from .estimate import CUDA_OVERHEAD_BYTES, HOST_OVERHEAD_BYTES, SHARED_PER_HOST, MemoryEstimate, estimate_memory
from .choice import PlacementChoice
from .search import choose_auto_settings, choose_placement, lean_support_reason
from .suggestions import suggest

__all__ = [
    "ACTIVATION_MARGIN", "CUDA_OVERHEAD_BYTES", "ENV_HOST_MEMORY", "FIT_SAFETY", "HEAD_MARGIN", "HOST_OVERHEAD_BYTES",
    "SHARED_PER_HOST", "Budget", "GiB", "InsufficientMemoryError", "MemoryEstimate", "MiB", "PlacementChoice", "Workload",
    "budget_for", "check_fit", "check_fit_on_ranks", "choose_auto_settings", "choose_placement", "estimate_memory",
    "fit_counts_compiled", "free_memory_needed", "head_bytes", "layer_activation_bytes", "lean_layer_bytes", "lean_row_tiled_bytes", "lean_support_reason", "materialized_masks",
    "place_on_ranks", "query_gpu_free_bytes", "query_host_available_bytes", "shared_state_bytes", "suggest",
    "summing_bytes", "working_set_bytes",
]
