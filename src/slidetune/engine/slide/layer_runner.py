"""How the slide engine runs a decoder layer: HF's layer or the lean one, eager or compiled.

Two entry points, the only two ways the engine runs a layer:
  forward(i, params, x, kwargs)                      no autograd: the forward pass, evaluation;
  recompute_backward(i, params, x, dy, kwargs, timer) the backward pass: recompute layer i from
      its checkpoint x and differentiate it against dy; returns (dx, one gradient per param),
      with "recompute" and "backward" timer spans around the two kinds of work.

HF's layer: one autograd graph of the whole layer (`run_layer`, torch.compile'd per kind of
layer with compile_layers). The lean layer (models/lean_layer.py): the attention half and the
MLP tiles, each compiled on its own where compile_layers is on, with the RMSNorm, SwiGLU and
rotary kernels lean_kernels picks (models/lean_kernels.py).
"""
from __future__ import annotations

import torch

from ...models.lean_kernels import resolve_lean_kernels
from ...models.layer_sides import LayerSides, SideRecompute
from ...models.lean_layer import LeanLayers
from ...models.units import SplitModel, run_layer
from ..config import RuntimeConfig


def resolve_lean_layer(split: SplitModel, rt: RuntimeConfig) -> str:
    """lean_layer as the engine runs it. auto left unresolved (an engine built without the fit's
    placement) -> off, HF's layer; the fit's ladder of recipes resolves auto to on only where the
    lean working set makes the run fit (engine/fit/search._memory_recipes): on the H200 (benchmarks/NOTES.md
    "Lean layer") it holds 62% less than HF's compiled layer at 64 x 1024 tokens in row tiles for 11%
    more time, and at 16K tokens the same memory for 3-10% more. on: every decoder layer must be
    Llama's arithmetic."""
    if rt.layer.lean_layer != "auto":
        return rt.layer.lean_layer
    return "off"


# The compiled entry points, one function (one code object, so one Dynamo cache) per purpose; each
# is the plain layer computation, inlined into its graph.
def _forward_layer(module, params, hidden, kwargs, buffers):
    """run_layer for the no-grad forward and evaluation: [B, S, d] -> [B, S, d]."""
    return run_layer(module, params, hidden, kwargs, buffers)


def _recompute_layer(module, params, hidden, kwargs, buffers):
    """run_layer for the recompute the backward differentiates: [B, S, d] -> [B, S, d]."""
    return run_layer(module, params, hidden, kwargs, buffers)


def _forward_attention(layer, parts, x, kwargs):
    return LeanLayers.attention(layer, parts, x, kwargs)


def _recompute_attention(layer, parts, x, kwargs):
    return LeanLayers.attention(layer, parts, x, kwargs)


def _forward_mlp(layer, parts, h):
    return LeanLayers.mlp(layer, parts, h)


def _recompute_mlp(layer, parts, h):
    return LeanLayers.mlp(layer, parts, h)


class LayerRunner:
    def __init__(self, split: SplitModel, rt: RuntimeConfig, device: torch.device):
        """device: where the layers run (the lean layer's Liger kernels need CUDA)."""
        self.split = split
        self.lean = None
        if resolve_lean_layer(split, rt) == "on":
            kernels = resolve_lean_kernels(rt.layer.lean_kernels, device)
            self.lean = LeanLayers(split.layer_modules, rt.layer.mlp_tile_tokens, kernels,
                                   row_tokens=rt.layer.layer_row_tokens or None)
        self.compiled = rt.compiles_layers()
        L = split.num_layers
        # one compiled graph per kind of layer, keyed on a template module (dynamo guards on the
        # module object; one per layer would recompile L times)
        self._templates = [split.layer_template(i) for i in range(L)] if self.compiled else []
        # One compiled callable per purpose: the no-grad forward (an inference graph) and the recompute
        # under autograd (a forward/backward pair) are two graphs whatever is done, but as one function
        # the second is a recompile (guard failure "GLOBAL_STATE changed: grad_mode") sharing one code
        # object's cache and its recompile_limit (8), past which Dynamo silently runs the layer eager.
        # Two functions (distinct code objects) compile once each. 2026-11-29, tiny-llama, 2 layers:
        # 4 frames of one function before (grad mode x mask form) -> 1 frame each of two functions.
        hf, lean = self.compiled and self.lean is None, self.compiled and self.lean is not None
        self._layer = torch.compile(_forward_layer, dynamic=False) if hf else None
        self._layer_grad = torch.compile(_recompute_layer, dynamic=False) if hf else None
        # the lean halves, likewise per purpose: the MLP tile compiles for the full tile and the last, ragged one
        self._attention = torch.compile(_forward_attention, dynamic=False) if lean else None
        self._mlp = torch.compile(_forward_mlp, dynamic=False) if lean else None
        self._attention_grad = torch.compile(_recompute_attention, dynamic=False) if lean else None
        self._mlp_grad = torch.compile(_recompute_mlp, dynamic=False) if lean else None

    def _module_of(self, i: int):
        return self._templates[i] if self.compiled else self.split.layer_modules[i]

    def _buffers(self, i: int, x: torch.Tensor) -> dict:
        """Layer i's constant buffers (models/buffers.py) for its template: layer i's values."""
        return self.split.layer_buffers.of(i, x.device, x.dtype)

    def forward(self, i: int, params: dict, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """Layer i's output [B, S, d] on the given parameter views (call under no_grad)."""
        if self.lean is not None:
            return self.lean.forward(i, params, x, kwargs, attention=self._attention, mlp=self._mlp,
                                     layer=self._module_of(i))
        if self._layer is not None:
            return self._layer(self._templates[i], params, x, kwargs, self._buffers(i, x))
        return self.split.layer_forward(i, params, x, kwargs)

    def recompute_backward(self, i: int, params: dict, x: torch.Tensor, grad_out: torch.Tensor, kwargs: dict,
                           timer, sides: LayerSides | None = None) -> tuple[torch.Tensor, ...]:
        """(d x, one gradient per entry of `params`) of layer i at input x against grad_out
        (consumed). `params` are autograd leaves over the slot's memory. `sides`: the micro-batch's
        side inputs (models/layer_sides.py: Gemma 4's per-layer inputs and shared K/V), whose
        gradients are kept there."""
        if self.lean is not None:
            return self.lean.recompute_backward(i, params, x, grad_out, kwargs, timer=timer,
                                                attention=self._attention_grad, mlp=self._mlp_grad,
                                                layer=self._module_of(i))
        xi = x.detach().requires_grad_(True)
        side = SideRecompute(sides, i, kwargs) if sides is not None else None
        kwargs = side.kwargs if side is not None else kwargs
        with torch.enable_grad():
            with timer.span("recompute", i):
                if self._layer_grad is not None:
                    out = self._layer_grad(self._templates[i], params, xi, kwargs, self._buffers(i, xi))
                else:
                    out = self.split.layer_forward(i, params, xi, kwargs)
            with timer.span("backward", i):
                if side is None:
                    return torch.autograd.grad(out, [xi] + list(params.values()), grad_out, materialize_grads=True)
                outs, grads = side.outputs(out, grad_out)
                return side.finish(torch.autograd.grad(outs, side.inputs(xi, params.values()), grads,
                                                       materialize_grads=True))
