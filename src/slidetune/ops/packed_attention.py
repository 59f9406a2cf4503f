"""Document-masked attention for packed rows: transformers' own pieces, one name.

Packing "masked" (data/batch.py) gives each packed row position ids that restart at 0 at
every document. From those, transformers' `create_causal_mask` finds the documents
(`masking_utils.find_packed_sequence_indices`: a new document wherever the position does not
grow by 1) and ANDs "same document" into the causal mask function. What that mask function
becomes depends on the attention implementation; "slidetune_packed" picks per device:

  CUDA  transformers' `flex_attention_mask` -> a FlexAttention `BlockMask`
        (`torch.nn.attention.flex_attention.create_block_mask`) and transformers'
        `flex_attention_forward`: 128 x 128 tiles wholly outside a document are skipped, so a
        row of ~10 documents computes ~1/10 of the causal triangle.
  CPU   transformers' `sdpa_mask` -> a boolean block-diagonal causal mask [B, 1, S, S] and
        `sdpa_attention_forward` (flex has no CPU backward; the tests run here).

A batch without a document boundary (every row one document) gets the same kind of mask, one
document per row (packed_mask: one form for every batch, so a compiled layer compiles once).
No kernel of our own. Under compile_layers the mask is an input of the compiled layer:
a fixed-shape bool tensor on CPU; on CUDA a BlockMask, whose mask_mod closure tensors
(the per-row document ids) torch >= 2.10 lifts into pytree leaves, so a new mask per
micro-batch is new data, not a new graph (tests/test_packing.py checks the CPU case,
benchmarks/scripts/packing_bench.py counts recompiles on the GPU).

`use_packed_attention(model_or_config)` registers the implementation and points the config
at it; the sliding split runs the skeleton's own layers, so it needs nothing else.
"""
from __future__ import annotations

import torch

from . import sink_attention

IMPL_NAME = "slidetune_packed"
# implementations that already honour the packed-sequence mask transformers builds: keep them
# (slidetune_local ANDs any mask it is given into its band)
_KEEP = ("slidetune_local", IMPL_NAME, sink_attention.PACKED_IMPL_NAME)
# implementations that have a packed counterpart of their own: attention sinks (gpt-oss, whose masks
# transformers builds without the documents: sink_attention.py)
_PACKED = {sink_attention.IMPL_NAME: sink_attention.PACKED_IMPL_NAME}


def _on_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def _has_documents(mask_function) -> bool:
    """Whether transformers ANDed its packed-sequence function into `mask_function` (found in the
    closures of and_masks / or_masks, which keep their parts there)."""
    seen, todo = set(), [mask_function]
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        if getattr(fn, "__qualname__", "").startswith("packed_sequence_mask_function"):
            return True
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:              # a cell not yet filled
                continue
            todo.extend(v for v in (value if isinstance(value, (tuple, list)) else (value,)) if callable(v))
    return False


def packed_mask(batch_size: int, q_length: int, kv_length: int, *, device="cpu", mask_function=None, **kwargs):
    """AttentionMaskInterface entry: a BlockMask on CUDA, a bool SDPA mask elsewhere, for every batch.

    One form for every batch, so that a compiled layer (compile_layers) is compiled once: a batch without a
    document boundary (transformers then finds no packed sequence: find_packed_sequence_indices) gets the
    same mask function as one with boundaries, ANDed with one document per row (document ids all 0: the
    same mask, the same values), and SDPA's mask is always built (allow_is_causal_skip off; otherwise
    None, is_causal). Measured 2026-11-29 (tiny-llama, 2 compiled layers, `slidetune train` on CPU): the
    first batch with a boundary recompiled the layer's no-grad and grad graphs, 4 compiles -> 2."""
    from transformers.masking_utils import (and_masks, flex_attention_mask, packed_sequence_mask_function,
                                            sdpa_mask)
    if mask_function is not None and not _has_documents(mask_function):
        one_document = torch.zeros((batch_size, kv_length), dtype=torch.int64, device=device)    # [B, S]
        mask_function = and_masks(mask_function, packed_sequence_mask_function(one_document))
    if _on_cuda(device):
        kwargs.pop("allow_is_causal_skip", None)
        return flex_attention_mask(batch_size, q_length, kv_length, device=device, mask_function=mask_function,
                                   **kwargs)
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(batch_size, q_length, kv_length, device=device, mask_function=mask_function, **kwargs)


def packed_attention(module, query, key, value, attention_mask, **kwargs):
    """AttentionInterface entry; q: [B, H, S, D], k/v: [B, Hkv, S, D] -> ([B, S, H, D], None)."""
    from torch.nn.attention.flex_attention import BlockMask
    if isinstance(attention_mask, BlockMask):
        from transformers.integrations.flex_attention import flex_attention_forward
        if torch.is_autocast_enabled(query.device.type):
            # flex_attention is no autocast op (SDPA is): cast as autocast would cast SDPA's inputs
            dt = torch.get_autocast_dtype(query.device.type)
            query, key, value = query.to(dt), key.to(dt), value.to(dt)
        return flex_attention_forward(module, query, key, value, attention_mask, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def block_mask_rows(mask, r0: int, r1: int):
    """The BlockMask of rows [r0, r1) of a batch: its block tables sliced, and a mask_mod that
    reads the original rows (b + r0). BlockMask's own indexing leaves a mask_mod that raises
    (the per-row document ids its closure holds are indexed by the full batch's row); a table of
    one row (shared by every row) is kept. The offset is a tensor, so a compiled layer sees new
    data for each tile, not a new graph. None where the mask carries a dq_kv_order (no slicing
    of it is defined)."""
    from torch.nn.attention.flex_attention import BlockMask
    if getattr(mask, "dq_kv_order", None) is not None:
        return None
    shared = mask.kv_num_blocks.shape[0] == 1
    rows = slice(None) if shared else slice(r0, r1)
    full = mask.full_kv_num_blocks is not None
    offset = torch.tensor(r0, dtype=torch.int32, device=mask.kv_num_blocks.device)
    original = mask.mask_mod

    def mask_mod(b, h, q_idx, kv_idx):
        return original(b + offset, h, q_idx, kv_idx)
    return BlockMask.from_kv_blocks(
        mask.kv_num_blocks[rows], mask.kv_indices[rows],
        mask.full_kv_num_blocks[rows] if full else None, mask.full_kv_indices[rows] if full else None,
        BLOCK_SIZE=mask.BLOCK_SIZE, mask_mod=mask_mod, seq_lengths=mask.seq_lengths,
        compute_q_blocks=mask.q_indices is not None)


def register() -> str:
    from transformers import AttentionInterface, AttentionMaskInterface
    AttentionInterface.register(IMPL_NAME, packed_attention)
    AttentionMaskInterface.register(IMPL_NAME, packed_mask)
    return IMPL_NAME


def use_packed_attention(target):
    """Make a HF model (or its config) mask attention per document of a packed row.

    Models on "sdpa" (the skeleton's default) or "eager" move to "slidetune_packed", a sink model
    (gpt-oss) to "slidetune_sinks_packed"; an implementation that already applies transformers'
    mask (slidetune_local) is kept.
    Returns the target.
    """
    register()
    config = getattr(target, "config", target)
    current = getattr(config, "_attn_implementation", None)
    if current in _KEEP:
        return target
    impl = _PACKED.get(current, IMPL_NAME)
    if hasattr(target, "set_attn_implementation"):
        target.set_attn_implementation(impl)
    else:
        config._attn_implementation = impl
    return target
