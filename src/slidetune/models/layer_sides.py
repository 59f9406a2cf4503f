"""What a micro-batch's decoder layers receive beside hidden_states that the units compute, not the
base model's forward (Gemma 4 E2B / E4B): per-layer inputs and KV sharing.

- Per-layer inputs (`hidden_size_per_layer_input` > 0): the embedding unit computes a
  [B, S, L, D_pl] tensor from the tokens and the embeddings (units.SplitModel.per_layer_inputs;
  embed_tokens_per_layer, per_layer_model_projection and per_layer_projection_norm are the
  embedding unit's parameters); layer i is handed its slice [B, S, D_pl] as `per_layer_input`.
  Each layer's own per-layer weights (per_layer_input_gate, per_layer_projection,
  post_per_layer_input_norm) are ordinary layer parameters.
- KV sharing (`num_kv_shared_layers` > 0): transformers' layers hand keys and values on through
  `shared_kv_states`: the last layer of each attention type before the shared ones stores its K/V
  there, the shared layers at the end of the stack read them. One store (SharedKV) per micro-batch,
  shared by its layers' kwargs.

The plain engine runs every layer under one autograd graph: the slices and the store carry the
graph and nothing more is needed. The slide engine's backward recomputes one layer at a time
(engine/slide/layer_runner.py), last layer first: `SideRecompute` makes a layer's slice and the
K/V a shared layer reads autograd leaves, keeps their gradients here (each layer's slice gradient
in `LayerSides.per_layer_grad`, the shared K/V's summed over the shared layers in `SharedKV.grads`),
and differentiates the producer's recomputed K/V against that sum when its turn comes (every shared
layer comes after every producer, so its backward runs first). The embedding unit's backward then
differentiates the per-layer inputs against `per_layer_grad`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class SharedKV(dict):
    """transformers' `shared_kv_states` for one micro-batch: layer type -> (keys, values), each
    [B, kv_heads, S, head_dim], stored by the type's producer layer, read by the KV-shared layers.
    The slide engine keeps them on the GPU from the producer's forward to its backward (one pair per
    attention type, each B x kv_heads x S x head_dim: E2B's one KV head makes them small beside the
    hidden state), and in `grads` the shared layers' gradients of them, summed, until the producer's
    backward reads them."""

    def __init__(self):
        super().__init__()
        self.grads: dict[str, list[torch.Tensor]] = {}


class _RecomputeKV(dict):
    """The store a layer sees in its recompute: a read (a shared layer's) returns the forward's K/V as
    fresh autograd leaves, kept in `read`; a write (the producer's, with its graph) is kept in
    `written`, the forward's copy left as it is."""

    def __init__(self, store: SharedKV):
        super().__init__()
        self.store = store
        self.read: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.written: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __getitem__(self, key):
        keys, values = self.store[key]
        leaves = (keys.detach().requires_grad_(True), values.detach().requires_grad_(True))
        self.read[key] = leaves
        return leaves

    def __setitem__(self, key, value) -> None:
        self.written[key] = value


@dataclass
class LayerSides:
    """One micro-batch's side inputs: the per-layer inputs [B, S, L, D_pl] (None without them) and the
    KV store (None without KV sharing); `per_layer_grad` [B, S, L, D_pl], each layer's slice
    gradient, filled by the slide engine's backward (None until the first layer's)."""

    per_layer: torch.Tensor | None
    kv: SharedKV | None
    per_layer_grad: torch.Tensor | None = None


class SideRecompute:
    """One layer's recompute with its side inputs as autograd leaves: run the layer with `kwargs`,
    then differentiate `outputs(out, grad_out)` against `inputs(x, params)` and hand the gradients to
    `finish`, which keeps the side inputs' and returns (d x, one gradient per parameter)."""

    def __init__(self, sides: LayerSides, i: int, kwargs: dict):
        self.sides, self.i = sides, i
        self.kwargs = dict(kwargs)
        self.per_layer = None
        if sides.per_layer is not None:
            self.per_layer = sides.per_layer[:, :, i].detach().requires_grad_(True)    # [B, S, D_pl]
            self.kwargs["per_layer_input"] = self.per_layer
        self.kv = _RecomputeKV(sides.kv) if sides.kv is not None else None
        if self.kv is not None:
            self.kwargs["shared_kv_states"] = self.kv

    def _leaves(self) -> list[torch.Tensor]:
        """The side inputs' leaves, in a fixed order: the slice, then each K/V pair read."""
        leaves = [self.per_layer] if self.per_layer is not None else []
        if self.kv is not None:
            for pair in self.kv.read.values():
                leaves.extend(pair)
        return leaves

    def _produced(self) -> list[str]:
        """The layer types whose K/V this layer wrote and the shared layers read (their gradients summed)."""
        return [t for t in self.kv.written if t in self.sides.kv.grads] if self.kv is not None else []

    def outputs(self, out: torch.Tensor, grad_out: torch.Tensor) -> tuple[list, list]:
        """(the tensors to differentiate, their gradients): the layer's output, and a producer's K/V."""
        outs, grads = [out], [grad_out]
        for t in self._produced():
            outs.extend(self.kv.written[t])
            grads.extend(self.sides.kv.grads[t])
        return outs, grads

    def inputs(self, x: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
        return [x] + self._leaves() + list(params)

    def finish(self, grads: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Keep the side inputs' gradients (the slice's in per_layer_grad, a shared layer's K/V's summed
        into the store's), drop what a producer's backward consumed, and return (d x, parameters' grads)."""
        sides, n = self.sides, 1 + len(self._leaves())
        side = list(grads[1:n])
        if self.per_layer is not None:
            if sides.per_layer_grad is None:
                sides.per_layer_grad = torch.zeros_like(sides.per_layer)              # [B, S, L, D_pl]
            sides.per_layer_grad[:, :, self.i].copy_(side.pop(0))
        if self.kv is not None:
            for t in self._produced():
                del sides.kv.grads[t]
                sides.kv.pop(t, None)            # the forward's K/V: no layer reads them any more
            for t in self.kv.read:
                g = [side.pop(0), side.pop(0)]
                if t in sides.kv.grads:
                    torch._foreach_add_(sides.kv.grads[t], g)
                else:
                    sides.kv.grads[t] = g
        return (grads[0], *grads[n:])
