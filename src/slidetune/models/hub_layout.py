"""A checkpoint's tensor names mapped onto the model's, by transformers' own conversion rules.

transformers 5 models hold a MoE layer's experts fused (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]), while the Hub's checkpoints (and what transformers'
`save_pretrained` writes: it reverts the conversion on save) store them one expert at a time
(`mlp.experts.0.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.0.w1.weight` ...), and a few
families rename tensors besides (Mixtral's `block_sparse_moe.` -> `mlp.`, routers' correction
biases). transformers converts on load with the model's `WeightTransform`s
(`conversion_mapping.get_model_conversion_mapping`); this module reads the same objects, so every
family transformers converts is covered by its own rules, and builds a fused tensor itself: straight
into one destination, an expert at a time (transformers' `MergeModulelist` + `Concatenate` stack
then concatenate, holding the layer's experts twice).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Pieces:
    """A model tensor the checkpoint holds in pieces, as one `WeightConverter` of transformers
    describes it: `keys[j]` the checkpoint's tensors matching its j-th source pattern (experts in
    index order), stacked along dim 0 when `stacked` (MergeModulelist), the patterns' results
    concatenated along `cat_dim` of the model's tensor (Concatenate)."""
    target: str
    patterns: tuple[str, ...]
    keys: tuple[tuple[str, ...], ...]
    stacked: bool
    cat_dim: int | None
    unsupported: str | None = None      # the converter's operations, when not the above


def model_conversions(model: torch.nn.Module) -> list:
    """transformers' load-time weight transforms for `model` (empty for families it does not convert)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    return list(get_model_conversion_mapping(model))


def checkpoint_layout(keys, conversions: list) -> dict[str, str | Pieces]:
    """Model name -> the checkpoint key it is stored under (renamed) or the `Pieces` it is built from,
    for each checkpoint key the conversions change (a key they leave alone is the model's own name).
    Keys are taken in transformers' order (`dot_natural_key`: expert 10 after expert 9)."""
    from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key
    renamings = [c for c in conversions if not isinstance(c, WeightConverter)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    names: dict[str, str | Pieces] = {}
    grouped: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    converter_of: dict[str, object] = {}
    for key in sorted(keys, key=dot_natural_key):
        new, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            if new != key:
                names.setdefault(new, key)
            continue
        grouped[new][pattern].append(key)
        converter_of[new] = by_pattern[pattern]
    for target, found in grouped.items():
        conv = converter_of[target]
        names[target] = _pieces(target, conv, tuple(tuple(found.get(p, ())) for p in conv.source_patterns))
    return names


def _pieces(target: str, converter, keys: tuple[tuple[str, ...], ...]) -> Pieces:
    """The converter's operations as a placement: only the merge/concatenate chains the MoE families
    use (anything else is named when the tensor is read, not guessed at)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist
    ops = list(converter.operations)
    kinds = [type(op) for op in ops]
    patterns = tuple(converter.source_patterns)
    if kinds and kinds[0] is MergeModulelist and ops[0].dim == 0 and kinds[1:] in ([], [Concatenate]):
        return Pieces(target, patterns, keys, True, ops[1].dim if len(ops) == 2 else None)
    if kinds == [Concatenate]:
        return Pieces(target, patterns, keys, False, ops[0].dim)
    return Pieces(target, patterns, keys, False, None, unsupported=" + ".join(k.__name__ for k in kinds))


def assemble(pieces: Pieces, shape: tuple[int, ...], read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The model's tensor of `shape` built from its pieces, each read (`read(key)`) and copied into
    place before the next: host memory holds the result and one piece. Dtype: the pieces' own."""
    if pieces.unsupported:
        raise ValueError(f"{pieces.target}: the checkpoint stores it as {pieces.keys[0][:1]}..., which transformers "
                         f"converts by {pieces.unsupported}; slidetune builds only stacked/concatenated experts")
    out: torch.Tensor | None = None
    offset = 0
    for pattern, keys in zip(pieces.patterns, pieces.keys):
        if not keys:
            raise KeyError(f"{pieces.target}: the checkpoint has no tensor matching {pattern!r} "
                           f"(it has {_first(pieces)} ...)")
        if pieces.stacked and len(keys) != shape[0]:
            raise ValueError(f"{pieces.target}: the model has {shape[0]} experts, the checkpoint {len(keys)} "
                             f"tensors matching {pattern!r} ({keys[0]} ...)")
        for e, key in enumerate(keys if pieces.stacked else keys[:1]):
            t = read(key)
            if out is None:
                out = torch.empty(shape, dtype=t.dtype)
            dst = _slot(out[e] if pieces.stacked else out, pieces, offset, t, key)
            dst.copy_(t)
        if pieces.cat_dim is not None:
            offset += t.shape[pieces.cat_dim - pieces.stacked]
    if pieces.cat_dim is not None and offset != shape[pieces.cat_dim]:
        raise ValueError(f"{pieces.target}: its pieces fill {offset} of {shape[pieces.cat_dim]} along dim "
                         f"{pieces.cat_dim} (model shape {shape})")
    return out


def _slot(dst: torch.Tensor, pieces: Pieces, offset: int, t: torch.Tensor, key: str) -> torch.Tensor:
    """Where piece `t` goes in `dst` (an expert's slice, or the whole tensor), its shape checked: a
    mismatched piece must not broadcast into place."""
    if pieces.cat_dim is not None:
        d = pieces.cat_dim - pieces.stacked        # the per-expert piece has no expert dim
        if t.dim() != dst.dim() or offset + t.shape[d] > dst.shape[d]:
            raise ValueError(f"{key}: shape {tuple(t.shape)} does not fit {pieces.target} {tuple(dst.shape)} "
                             f"at offset {offset} along dim {d}")
        dst = dst.narrow(d, offset, t.shape[d])
    if tuple(t.shape) != tuple(dst.shape):
        raise ValueError(f"{key}: shape {tuple(t.shape)} != its place in {pieces.target} {tuple(dst.shape)}")
    return dst


def _first(pieces: Pieces) -> str:
    return next((ks[0] for ks in pieces.keys if ks), "nothing")


# ---- saving: the layout transformers' save_pretrained writes ---------------------------------

@dataclass(frozen=True)
class HubNames:
    """How transformers' `save_pretrained` names a model's tensors (its load conversion reverted):
    `layout` as checkpoint_layout gives it for those names, `shapes` each saved tensor's shape."""
    layout: dict[str, str | Pieces]
    shapes: dict[str, tuple[int, ...]]

    def name(self, model_name: str) -> str:
        """The saved name of a tensor saved whole (renamed, or its own)."""
        found = self.layout.get(model_name)
        return found if isinstance(found, str) else model_name


def hub_names(model: torch.nn.Module) -> HubNames:
    """transformers' save layout for `model` (a skeleton on `meta`: the reversal runs on shapes alone),
    read back through checkpoint_layout, so that what is written is exactly what is read."""
    from transformers.core_model_loading import revert_weight_conversion
    meta = {k: torch.empty(v.shape, device="meta") for k, v in model.state_dict().items()}
    saved = revert_weight_conversion(model, meta)
    layout = checkpoint_layout(saved, model_conversions(model))
    usable = {k: v for k, v in layout.items() if k in meta and not (isinstance(v, Pieces) and v.unsupported)}
    return HubNames(usable, {k: tuple(v.shape) for k, v in saved.items()})


def to_hub_layout(named, names: HubNames):
    """(name, tensor) pairs as transformers saves them: renamed, and a fused tensor cut into its
    pieces (each a contiguous copy of one expert's slice; a streamed tensor is read whole first,
    one parameter at a time)."""
    from ..engine.slide.disk_tier import StreamedTensor
    for name, t in named:
        found = names.layout.get(name)
        if not isinstance(found, Pieces):
            yield names.name(name), t
            continue
        whole = t.materialize() if isinstance(t, StreamedTensor) else t
        yield from _cut_pieces(found, whole, names.shapes)


def _cut_pieces(pieces: Pieces, t: torch.Tensor, shapes: dict[str, tuple[int, ...]]):
    """assemble()'s placement run backwards: each piece's slice of the model tensor `t`."""
    offset = 0
    for keys in pieces.keys:
        for e, key in enumerate(keys if pieces.stacked else keys[:1]):
            dst = t[e] if pieces.stacked else t
            if pieces.cat_dim is not None:
                d = pieces.cat_dim - pieces.stacked
                dst = dst.narrow(d, offset, shapes[key][d])
            if tuple(dst.shape) != shapes[key]:
                raise ValueError(f"{pieces.target}: its slice for {key} is {tuple(dst.shape)}, transformers "
                                 f"saves {shapes[key]}")
            yield key, dst.contiguous()
        if pieces.cat_dim is not None:
            offset += shapes[keys[0]][pieces.cat_dim - pieces.stacked]
