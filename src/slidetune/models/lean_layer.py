"""A lean decoder layer: the same arithmetic as the family's HF layer, holding less at once.

What one decoder layer's recompute + backward holds is what binds a small GPU:
HF's Llama-style layer keeps, per token, about 13 d of compute-dtype values for its MLP
(the norm's FP32 input, its output, gate, up, SiLU(gate), the product) and about 12 d for
the attention half, so one Qwen3-8B layer at 64K tokens needs ~20 GiB. Two changes, each
exact (the equivalence tests compare against the HF layer, FP32 on the CPU):

- **RMSNorm that saves only its input and the per-row 1/rms** (`rms_norm`). HF's keeps the
  FP32 upcast of its input (4 B/element) and the normalized value (b B/element) besides;
  the backward here recomputes them, in row chunks so its FP32 temporaries stay bounded.
  Applied to every RMSNorm of the layer whose forward is Llama's (input, post-attention,
  and Qwen3's per-head q/k norms), by giving the module instance a lean `forward`.
- **The MLP half in token tiles.** `y = h + mlp(norm(h))` acts on each token alone, so the
  recompute + backward runs it a tile of `tile_tokens` tokens at a time: each tile is
  recomputed and differentiated at once, before the next (the MLP's intermediates exist for
  one tile only; no extra forward: the MLP's recompute is its tile's). The weight gradients
  of the tiles are summed in FP32 and rounded once, as one GEMM over all tokens rounds once.
  The forward (no grad) runs the MLP in the same tiles.

Attention stays HF's own module (SDPA: flash / memory-efficient kernels, or FlexAttention
for packed documents), called with the layer's recorded kwargs.

**Kernels** (`LeanKernels`): the RMSNorm, the SwiGLU product `act(gate) * up` and the rotary
application are swappable, per module instance (the norms' and the MLP's `forward`, and the
attention's forward with another `apply_rotary_pos_emb`), so one HF layer runs other kernels
without touching its class or its modeling module. `TORCH`: the lean RMSNorm below and HF's
own product and rotary; `models/lean_kernels.py`: Liger's Triton kernels on CUDA.

Faithful or refused: a layer is run lean only where its class's `forward`, its MLP's and
its RMSNorms' are Llama's, statement for statement (`lean_support` compares the source, so
a family that changes any of them - Gemma's (1 + w) norm, sandwich norms, an MoE block -
keeps HF's layer; no family list to keep in step with transformers).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import re
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

# Row chunk of the RMSNorm backward: bounds its FP32 temporaries (x upcast, x_hat, their
# product) to ~3 x 4 B x rows x d: 16K rows of a 4096-wide layer = 0.75 GiB.
_NORM_BACKWARD_ROWS = 16384


# ----------------------------------------------------------------------------- RMSNorm
class _RMSNorm(torch.autograd.Function):
    """y = w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), the normalization in FP32 (LlamaRMSNorm).

    Saves x (usually alive anyway: the layer input, the residual stream, a projection's
    output) and rstd [..., 1] FP32; HF's autograd keeps x in FP32 and x_hat besides."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.to(torch.float32)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)        # [..., 1]
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        d = x.shape[-1]
        xs, gs, rs = x.reshape(-1, d), grad.reshape(-1, d), rstd.reshape(-1, 1)
        dx = torch.empty_like(xs) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(d, dtype=torch.float32, device=x.device) if ctx.needs_input_grad[1] else None
        for s in range(0, xs.shape[0], _NORM_BACKWARD_ROWS):
            e = min(s + _NORM_BACKWARD_ROWS, xs.shape[0])
            x_hat = xs[s:e].to(torch.float32) * rs[s:e]                   # [r, d] FP32
            g = gs[s:e]
            if dw is not None:
                # HF: the gradient of `weight * h` (h = x_hat in x's dtype) summed over rows
                dw += (g * x_hat.to(x.dtype)).to(torch.float32).sum(0)
            if dx is not None:
                dh = (g * weight).to(torch.float32)                        # d/d x_hat
                dx[s:e] = (rs[s:e] * (dh - x_hat * (dh * x_hat).mean(-1, keepdim=True))).to(x.dtype)
        return (dx.view_as(x) if dx is not None else None,
                dw.to(weight.dtype) if dw is not None else None, None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's forward, with the lean backward above."""
    return _RMSNorm.apply(x, weight, eps)


# ----------------------------------------------------------------------------- kernels
@dataclass(frozen=True)
class LeanKernels:
    """The lean layer's three elementwise ops; None: HF's own code for that op.

    rms_norm(x [..., d], weight [d], eps) -> [..., d]: LlamaRMSNorm's forward.
    silu_mul(gate [..., I], up [..., I]) -> silu(gate) * up: LlamaMLP's product (SiLU MLPs only).
    rope(q [B, hq, S, hd], k [B, hk, S, hd], cos [B, S, hd], sin, unsqueeze_dim=1) -> (q, k):
        Llama's apply_rotary_pos_emb (rotate_half convention); it may write into q and k."""
    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    rope: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None


TORCH = LeanKernels("torch", rms_norm=rms_norm)


def _norm_forward(op):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return op(hidden_states, self.weight, self.variance_epsilon)
    return forward


def _mlp_forward(op):
    def forward(self, x: torch.Tensor) -> torch.Tensor:       # LlamaMLP.forward, act(gate) * up as one op
        return self.down_proj(op(self.gate_proj(x), self.up_proj(x)))
    return forward


def _with_global(fn, name: str, value):
    """A copy of function `fn` that sees `value` for its global `name`; its module is untouched
    (a model of the same family elsewhere in the process keeps HF's function)."""
    scope = {**fn.__globals__, name: value}
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    return copy


# ----------------------------------------------------------------------------- faithfulness
@functools.cache
def _body(fn) -> str:
    """A function's statements without its signature, docstring, comments and blank lines (read once
    per function: lean_support runs per layer each time the auto settings weigh the lean layer, and
    inspect.getsource re-tokenizes the whole source file, ~1 ms)."""
    src = textwrap.dedent(inspect.getsource(fn))
    src = src.split(":\n", 1)[1] if re.match(r"\s*def ", src) else src
    src = re.sub(r'"""[\s\S]*?"""', "", src)
    lines = [ln.split("#", 1)[0].strip() for ln in src.splitlines()]
    return "\n".join(ln for ln in lines if ln)


@functools.cache
def _llama_bodies() -> dict[str, str]:
    from transformers.models.llama import modeling_llama as m
    return {"layer": _body(m.LlamaDecoderLayer.forward), "mlp": _body(m.LlamaMLP.forward),
            "norm": _body(m.LlamaRMSNorm.forward), "rope": _body(m.apply_rotary_pos_emb),
            "rotate_half": _body(m.rotate_half)}


def _is_llama_norm(module: nn.Module, bodies: dict[str, str]) -> bool:
    return (hasattr(module, "weight") and hasattr(module, "variance_epsilon")
            and _body(type(module).forward) == bodies["norm"])


def lean_support(layer: nn.Module) -> str | None:
    """None if `layer` computes exactly what LlamaDecoderLayer does (so the lean layer is the
    same arithmetic), else why not."""
    bodies = _llama_bodies()
    if any(True for _ in layer.buffers()):
        # the lean halves pass the layer's parameters alone (models/buffers.py's are HF's layer's)
        return f"{type(layer).__name__} keeps buffers"
    if _body(type(layer).forward) != bodies["layer"]:
        return f"{type(layer).__name__}.forward is not Llama's decoder layer"
    for name in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp"):
        if not isinstance(getattr(layer, name, None), nn.Module):
            return f"{type(layer).__name__} has no {name}"
    if _body(type(layer.mlp).forward) != bodies["mlp"]:
        return f"{type(layer.mlp).__name__}.forward is not Llama's SwiGLU MLP"
    for name in ("input_layernorm", "post_attention_layernorm"):
        if not _is_llama_norm(getattr(layer, name), bodies):
            return f"{type(getattr(layer, name)).__name__}.forward is not Llama's RMSNorm"
    return None


def lean_support_reason(split) -> str | None:
    """None where every decoder layer of `split` (models.units.SplitModel) can run lean (lean_support),
    else why not."""
    return next((why for why in map(lean_support, split.layer_modules) if why is not None), None)


def rope_support(attn: nn.Module) -> str | None:
    """None if `attn`'s forward applies the rotary embedding by calling its module's
    `apply_rotary_pos_emb`, and that function (and its rotate_half) is Llama's: then swapping
    that name swaps the rotary application and nothing else. Else why not."""
    fn = type(attn).forward
    scope, bodies = fn.__globals__, _llama_bodies()
    if "apply_rotary_pos_emb" not in fn.__code__.co_names:
        return f"{type(attn).__name__}.forward does not call apply_rotary_pos_emb"
    if "apply_rotary_pos_emb" not in scope or _body(scope["apply_rotary_pos_emb"]) != bodies["rope"] \
            or "rotate_half" not in scope or _body(scope["rotate_half"]) != bodies["rotate_half"]:
        return f"{type(attn).__name__}'s apply_rotary_pos_emb is not Llama's"
    return None


def silu_mul_support(mlp: nn.Module) -> str | None:
    """None if `mlp`'s act_fn is SiLU (a layer lean_support accepts computes act(gate) * up)."""
    from transformers.activations import SiLUActivation
    act = getattr(mlp, "act_fn", None)
    return None if isinstance(act, (nn.SiLU, SiLUActivation)) else f"the MLP's activation is {type(act).__name__}"


# ----------------------------------------------------------------------------- the layer
@dataclass
class _Parts:
    """One layer's parameters by the sub-module that takes them (local names within it)."""
    norm1: dict[str, torch.Tensor]
    attn: dict[str, torch.Tensor]
    norm2: dict[str, torch.Tensor]
    mlp: dict[str, torch.Tensor]


def _parts(params: dict[str, torch.Tensor]) -> _Parts:
    groups: dict[str, dict[str, torch.Tensor]] = {"input_layernorm": {}, "self_attn": {},
                                                   "post_attention_layernorm": {}, "mlp": {}}
    for name, t in params.items():
        head, _, rest = name.partition(".")
        groups[head][rest] = t
    return _Parts(groups["input_layernorm"], groups["self_attn"], groups["post_attention_layernorm"], groups["mlp"])


def _fp32_sum(sums: list[torch.Tensor] | None, grads) -> list[torch.Tensor]:
    """The running FP32 sum of tiles' weight gradients after adding `grads` (the first copied into
    FP32): one rounding into the weights' dtype at the end, as one GEMM over all tokens rounds once."""
    if sums is None:
        return [t.to(torch.float32, copy=True) for t in grads]
    for acc, t in zip(sums, grads):
        acc += t
    return sums


def _rows_cuttable(value, batch: int) -> bool:
    """Whether every tensor among a layer's kwargs is per row ([B, ...] with B = batch, cut with
    the rows), shared by the rows ([1, ...], or 1-D such as cache_position [S]) or not a tensor;
    a FlexAttention block mask (packed documents on CUDA) is cut by ops.packed_attention's
    block_mask_rows; anything else is not (the layer then runs all rows)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if _is_block_mask(value):
        return getattr(value, "dq_kv_order", None) is None
    if isinstance(value, torch.Tensor):
        return value.dim() <= 1 or value.shape[0] in (1, batch)
    if isinstance(value, (tuple, list)):
        return all(_rows_cuttable(v, batch) for v in value)
    if isinstance(value, dict):
        return all(_rows_cuttable(v, batch) for v in value.values())
    return False


def _is_block_mask(value) -> bool:
    from torch.nn.attention.flex_attention import BlockMask
    return isinstance(value, BlockMask)


def _rows_of(value, r0: int, r1: int, batch: int):
    """The layer's kwargs for rows [r0, r1) (_rows_cuttable says they can be cut)."""
    if _is_block_mask(value):
        from ..ops.packed_attention import block_mask_rows
        return block_mask_rows(value, r0, r1)
    if isinstance(value, torch.Tensor):
        return value[r0:r1] if value.dim() >= 2 and value.shape[0] == batch and batch > 1 else value
    if isinstance(value, tuple):
        return tuple(_rows_of(v, r0, r1, batch) for v in value)
    if isinstance(value, list):
        return [_rows_of(v, r0, r1, batch) for v in value]
    if isinstance(value, dict):
        return {k: _rows_of(v, r0, r1, batch) for k, v in value.items()}
    return value


class LeanLayers:
    """The lean forward and recompute + backward of a model's decoder layers (module docstring).

    Built once per engine from the skeleton's layer modules, whose RMSNorms (and, where the
    kernels have them, MLPs and attentions) get `kernels`' ops as their instance's forward:
    the same values, less held for the backward. A layer whose class is not Llama's
    arithmetic is refused here (`lean_support`). `ops`: what runs each op, for the record
    ("torch", "liger", or "hf: why" where a module keeps HF's code for it)."""

    def __init__(self, layers: list[nn.Module], tile_tokens: int, kernels: LeanKernels = TORCH,
                 row_tokens: int | None = None):
        """tile_tokens: the MLP's token tiles; row_tokens: the recompute + backward's row tiles
        (sequences of at most this many tokens together; None: all rows at once)."""
        if tile_tokens < 1 or (row_tokens is not None and row_tokens < 1):
            raise ValueError(f"tile_tokens and row_tokens must be >= 1, not {tile_tokens}, {row_tokens}")
        for i, layer in enumerate(layers):
            why = lean_support(layer)
            if why is not None:
                raise ValueError(f"decoder layer {i} cannot run lean: {why}")
        self.layers = layers
        self.tile_tokens = tile_tokens
        self.row_tokens = row_tokens
        self.kernels = kernels
        self.ops = self._install_kernels()

    def _install_kernels(self) -> dict[str, str]:
        k, bodies = self.kernels, _llama_bodies()
        ops = {"rms_norm": k.name, "silu_mul": k.name if k.silu_mul else "hf", "rope": k.name if k.rope else "hf"}

        def install(m: nn.Module, forward) -> None:
            m.forward = types.MethodType(forward, m)
            m._slidetune_kernels = k.name
        for layer in self.layers:
            for m in layer.modules():
                if getattr(m, "_slidetune_kernels", None) is not None:   # an earlier LeanLayers' ops
                    del m.forward, m._slidetune_kernels
            for m in layer.modules():
                if _is_llama_norm(m, bodies):
                    install(m, _norm_forward(k.rms_norm))
            if k.silu_mul is not None:
                why = silu_mul_support(layer.mlp)
                if why is None:
                    install(layer.mlp, _mlp_forward(k.silu_mul))
                else:
                    ops["silu_mul"] = f"hf: {why}"
            if k.rope is not None:
                why = rope_support(layer.self_attn)
                if why is None:
                    forward = type(layer.self_attn).forward
                    install(layer.self_attn, _with_global(forward, "apply_rotary_pos_emb", k.rope))
                else:
                    ops["rope"] = f"hf: {why}"
        return ops

    # -- the two halves, on the layer's own modules ---------------------------------------
    @staticmethod
    def attention(layer: nn.Module, p: _Parts, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """h = x + self_attn(input_layernorm(x)), as LlamaDecoderLayer's first half: [B, S, d]."""
        n = functional_call(layer.input_layernorm, p.norm1, (x,))
        a = functional_call(layer.self_attn, p.attn, (), {"hidden_states": n, **kwargs})
        return x + (a[0] if isinstance(a, tuple) else a)

    @staticmethod
    def mlp(layer: nn.Module, p: _Parts, h: torch.Tensor) -> torch.Tensor:
        """mlp(post_attention_layernorm(h)) for a tile of tokens: [T, d] -> [T, d]."""
        return functional_call(layer.mlp, p.mlp, (functional_call(layer.post_attention_layernorm, p.norm2, (h,)),))

    def _tiles(self, n: int):
        return [(s, min(s + self.tile_tokens, n)) for s in range(0, n, self.tile_tokens)]

    # -- entry points ------------------------------------------------------------------
    def forward(self, i: int, params: dict[str, torch.Tensor], x: torch.Tensor, kwargs: dict,
                attention=None, mlp=None, layer: nn.Module | None = None) -> torch.Tensor:
        """The layer's output without autograd (the forward pass and evaluation): [B, S, d].
        `attention` / `mlp`: compiled versions of the two halves (same signatures); `layer`: a
        module built like layer i to run its parameters through (a compiled graph's template)."""
        layer, p = layer if layer is not None else self.layers[i], _parts(params)
        attention, mlp = attention or self.attention, mlp or self.mlp
        with torch.no_grad():
            h = attention(layer, p, x, kwargs)                              # [B, S, d]
            hf = h.view(-1, h.shape[-1])                                    # [N, d]
            for s, e in self._tiles(hf.shape[0]):
                hf[s:e] += mlp(layer, p, hf[s:e])
        return h

    def recompute_backward(self, i: int, params: dict[str, torch.Tensor], x: torch.Tensor, grad_out: torch.Tensor,
                           kwargs: dict, timer=None, attention=None, mlp=None,
                           layer: nn.Module | None = None) -> tuple[torch.Tensor, ...]:
        """Recompute layer i from its input `x` and differentiate it against `grad_out` (the
        gradient of its output; consumed: it becomes the MLP half's input gradient in place).
        Returns (d x, then one gradient per entry of `params`, in its order), as
        `torch.autograd.grad(layer(x), [x, *params.values()], grad_out)` would.

        Over row tiles (`row_tokens`): the whole layer a few sequences at a time, each tile
        recomputed and differentiated before the next, so what the attention half saves exists
        for one tile's tokens; the tiles' weight gradients are summed in FP32 and rounded once
        (one tile: exactly the untiled computation).

        `timer`: an EventTimer; the attention half's recompute and each tile's are "recompute"
        spans, the differentiations "backward" spans (several per layer; they add up)."""
        rows = self._row_tiles(x.shape[0], x.shape[1], kwargs)
        run = functools.partial(self._recompute_backward_rows, i, params, timer=timer, attention=attention, mlp=mlp,
                                layer=layer)
        if len(rows) == 1:
            return tuple(g.to(leaf.dtype) for g, leaf in zip(run(x, grad_out, kwargs), [x, *params.values()]))
        dx = torch.empty_like(x)                                            # [B, S, d]
        sums: list[torch.Tensor] | None = None                              # FP32, one per parameter
        for r0, r1 in rows:
            g = run(x[r0:r1], grad_out[r0:r1], _rows_of(kwargs, r0, r1, x.shape[0]))
            dx[r0:r1] = g[0]
            sums = _fp32_sum(sums, g[1:])
            del g
        return (dx,) + tuple(t.to(leaf.dtype) for t, leaf in zip(sums, params.values()))

    def _row_tiles(self, batch: int, seq: int, kwargs: dict) -> list[tuple[int, int]]:
        """[r0, r1) row ranges of at most row_tokens tokens (at least one row each); one range
        where the layer's kwargs cannot be cut by rows (a FlexAttention block mask)."""
        if self.row_tokens is None:
            return [(0, batch)]
        rows = max(1, self.row_tokens // max(seq, 1))
        if rows >= batch or not _rows_cuttable(kwargs, batch):
            return [(0, batch)]
        return [(r, min(r + rows, batch)) for r in range(0, batch, rows)]

    def _recompute_backward_rows(self, i: int, params: dict[str, torch.Tensor], x: torch.Tensor,
                                 grad_out: torch.Tensor, kwargs: dict, timer=None, attention=None, mlp=None,
                                 layer: nn.Module | None = None) -> tuple[torch.Tensor, ...]:
        """recompute_backward on these rows; the MLP's weight gradients come back as their
        tiles' FP32 sums where there are several MLP tiles (the caller rounds once)."""
        layer, p = layer if layer is not None else self.layers[i], _parts(params)
        attention, mlp = attention or self.attention, mlp or self.mlp
        span = timer.span if timer is not None else (lambda *_: contextlib.nullcontext())
        xi = x.detach().requires_grad_(True)
        with torch.enable_grad(), span("recompute", i):
            h = attention(layer, p, xi, kwargs)                             # [B, S, d], holds the attention's saved tensors
        d = h.shape[-1]
        hf = h.detach().view(-1, d)                                         # [N, d]
        dh = grad_out.reshape(-1, d)                                        # [N, d]: dy, then dy + d mlp/dh
        mlp_leaves = list(p.norm2.values()) + list(p.mlp.values())
        tiles = self._tiles(hf.shape[0])
        sums: list[torch.Tensor] | None = None
        for s, e in tiles:
            ht = hf[s:e].requires_grad_(True)
            with torch.enable_grad(), span("recompute", i):
                out = mlp(layer, p, ht)                                     # [T, d]
            with span("backward", i):
                g = torch.autograd.grad(out, [ht] + mlp_leaves, dh[s:e], materialize_grads=True)
            dh[s:e] += g[0]
            sums = list(g[1:]) if len(tiles) == 1 else _fp32_sum(sums, g[1:])
            del out, g, ht
        attn_leaves = list(p.norm1.values()) + list(p.attn.values())
        with span("backward", i):
            g = torch.autograd.grad(h, [xi] + attn_leaves, dh.view_as(h), materialize_grads=True)
        by_name = dict(zip([f"input_layernorm.{k}" for k in p.norm1] + [f"self_attn.{k}" for k in p.attn]
                           + [f"post_attention_layernorm.{k}" for k in p.norm2] + [f"mlp.{k}" for k in p.mlp],
                           list(g[1:]) + sums))
        return (g[0],) + tuple(by_name[k] for k in params)

