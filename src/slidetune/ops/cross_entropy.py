"""The output layer: hidden states -> logits -> summed cross-entropy, three ways.

    loss = linear_cross_entropy(hidden, weight, labels, impl="chunked")

Numerical contract (all impls): logits = hidden @ weight.T (+ bias) in the compute
dtype (torch's matmul, fp32 accumulate), upcast to float32 (float64 stays float64),
then log-softmax / cross-entropy in that dtype, SUMMED over the tokens whose label is
not -100. The caller divides by the step's token count (so that micro-batches add up).
The loss is a 0-dim float32 tensor (float64 when the compute dtype is float64).

Memory kept alive, N tokens (Nv of them not ignored), vocabulary V, width d, compute
dtype of b bytes (2 for bf16), c = chunk_tokens:

- ``full``: the reference, plain autograd over all N tokens. Forward materializes the
  logits (N*V*b bytes, freed after the upcast) and their fp32 copy; log_softmax keeps
  its fp32 output (4*N*V) for backward; backward adds an fp32 and a bf16 gradient of
  the same shape. Peak about 10*N*V bytes in bf16: 16K tokens x 128K vocab = 20 GB.
  Ignored tokens are computed (and masked), as in any plain HF loss.
- ``chunked``: a custom autograd Function. Only the Nv valid rows are ever multiplied.
  Forward walks them c at a time and computes, for each chunk, the logits (c*V*b),
  their fp32 upcast (4*c*V, an alias in fp32), the loss and at once the gradient of
  the chunk's logits (written over the fp32 buffer, cast back into the logits
  buffer), then grad_hidden rows (= grad_logits @ W) and grad_W += grad_logits.T @ h
  (accumulated in fp32: 4*V*d, only when there is more than one chunk). One chunk of
  logits is alive at a time. Kept for backward: grad_hidden (N*d*b), grad_weight
  (V*d*b), grad_bias (V*b): the same as the parameters and activations themselves.
  Backward only scales them by the incoming scalar (one more grad-sized tensor).
- ``fused``: the chunked path with a Triton kernel
  (``triton_ce.py``) that computes logsumexp and loss in one online sweep over the
  vocabulary and writes softmax - onehot in place over the compute-dtype logits
  buffer: per chunk only c*V*b bytes, no fp32 copy; liger-kernel's fused linear
  cross-entropy (on the valid rows only) where Triton alone does not import. Needs CUDA;
  elsewhere it raises.

Selecting the valid rows needs their count on the host: one device sync per call.

The final norm inside the chunks (``norm=RowNorm(...)``, chunked and fused): the head's
input is the last layer's raw output; each chunk is normed as it is multiplied, and the
norm's backward runs on the chunk's hidden gradient at once. Nothing N-sized is kept but
the input gradient (N*d*b): HF's norm over all N tokens keeps its FP32 upcast, the normed
output and their gradients (about (4 + 3b)*N*d: 2.5 GiB at 64K tokens x 4096). A row-wise
norm gives each token the same values chunk by chunk; its weight gradient is summed over
the chunks in FP32 (one chunk: exactly autograd's).

Per-token passes (the preference objectives, objectives/preference.py): ``linear_token_losses``
returns each token's cross-entropy [N] from the forward alone (a sequence's log-probability is
minus its tokens' sum), and ``linear_cross_entropy_grads`` with a tensor ``scale`` [N] gives each
token's gradients its own factor (a sequence's coefficient), multiplied into the chunk's logit
gradient in FP32 on the fly and rounded once, so all of hidden, weight, bias and norm gradients
carry it. A pair's loss needs both its sums before any gradient, hence the two passes.

Logit transforms (``LogitTransform``), applied to the fp32 logits exactly where the
model family's own forward applies them: z = scale * logits (Granite divides by
``logits_scaling``, Cohere multiplies by ``logit_scale``), then, with a softcap c,
z = c * tanh(z / c) (Gemma 2/3 ``final_logit_softcapping``). The chunked kernel carries
the chain rule through both (dz/dlogits = scale * (1 - tanh^2)), at one more [c, V]
fp32 buffer per chunk when a softcap is set. ``fused`` has no transform in its
kernels: with a transform it runs the chunked path with the torch kernel.

Measured once on an H100 (torch 2.11, Triton 3.6), bf16, forward + backward, 25% of
labels ignored, chunk_tokens=4096, peak allocated above the inputs:
  8192 tok, d=2048, V=128256:  full 33 ms / 11.7 GiB, chunked 30 ms / 5.9 GiB, fused 17 ms / 2.5 GiB
  16384 tok, d=4096, V=151936: full 119 ms / 27.8 GiB, chunked 104 ms / 8.3 GiB, fused 73 ms / 6.2 GiB
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100
IMPLS = ("full", "chunked", "fused")


# ---------------------------------------------------------------------------- public API


@dataclass(frozen=True)
class LogitTransform:
    """What a family's forward does to the logits before the loss: z = softcap(scale * logits)."""

    scale: float = 1.0             # multiplies the logits (1 / logits_scaling for Granite)
    softcap: float | None = None   # z = softcap * tanh(z / softcap) when set

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and not self.softcap

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Out of place (autograd-friendly), in the logits' dtype."""
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


IDENTITY = LogitTransform()


@dataclass(frozen=True)
class RowNorm:
    """A norm over the last dim applied to the head's input inside the chunks: fn(x, params) -> the
    normed x, the same shape and dtype, each row on its own (RMSNorm, LayerNorm: the family's own
    module through functional_call). params: its parameters by name."""

    fn: Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]
    params: dict[str, torch.Tensor]


def available_impls() -> list[str]:
    """The impls that can run on this machine ("fused" only with CUDA + Triton or liger)."""
    impls = ["full", "chunked"]
    if _fused_backend() is not None:
        impls.append("fused")
    return impls


def linear_cross_entropy(
    hidden: torch.Tensor,  # [N, d] compute dtype, already final-normed
    weight: torch.Tensor,  # [V, d] compute dtype (lm_head or tied embedding)
    labels: torch.Tensor,  # [N] int64, already shifted; -100 = ignored
    impl: str = "chunked",
    chunk_tokens: int = 4096,  # 4096 x 128K vocab x (2 + 4) bytes = 3 GB per chunk in bf16
    bias: torch.Tensor | None = None,  # [V]
    transform: LogitTransform = IDENTITY,  # the family's logit scaling / softcapping
    norm: RowNorm | None = None,  # the final norm, applied to hidden first (inside the chunks)
) -> torch.Tensor:
    """SUM over non-ignored tokens of the cross-entropy of ``transform(norm(hidden) @ weight.T + bias)``.

    Returns a 0-dim float32 tensor (float64 for float64 inputs). Gradients flow to
    hidden, weight, bias and the norm's parameters, whichever require grad. Leading dims
    of hidden/labels beyond [N, d] / [N] are flattened.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; choose one of {IMPLS}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden {tuple(hidden.shape)}")
    if labels.shape[0] != hidden.shape[0]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match hidden {tuple(hidden.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} does not match weight {tuple(weight.shape)}")
    labels = labels.long()

    if impl == "full":
        return _full(_normed(hidden, norm), weight, labels, bias, transform)
    if impl == "chunked" or (not transform.is_identity and hidden.is_cuda):
        # the fused kernels know no transform; the torch kernel applies it exactly
        return _chunked(hidden, weight, labels, bias, chunk_tokens, kernel="torch", transform=transform, norm=norm)

    backend = _fused_backend() if hidden.is_cuda else None
    if backend is None:
        where = "these tensors (not on CUDA)" if not hidden.is_cuda else "this machine"
        raise RuntimeError(
            f"impl='fused' needs CUDA tensors and Triton or liger-kernel; not available for "
            f"{where}. Available impls: {available_impls()}"
        )
    if backend == "liger":
        return _liger(_normed(hidden, norm), weight, labels, bias)
    if hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"impl='fused' supports bf16/fp16/fp32, got {hidden.dtype}; use 'chunked'")
    return _chunked(hidden, weight, labels, bias, chunk_tokens, kernel="triton", norm=norm)


def linear_cross_entropy_grads(
    hidden: torch.Tensor,  # [N, d] compute dtype
    weight: torch.Tensor,  # [V, d]
    labels: torch.Tensor,  # [N] int64; -100 = ignored
    scale: float | torch.Tensor,  # d total / d loss (the engine's 1 / the step's tokens), or [N]: each token's
    impl: str = "chunked",
    chunk_tokens: int = 4096,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = IDENTITY,
    norm: RowNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """(loss, d/d hidden, d/d weight, d/d bias or None, {norm parameter: d/d it}) of scale * the
    loss of linear_cross_entropy, without an autograd graph: the chunked paths compute every
    gradient in their loop and scale it in place. (Through autograd, backward makes a scaled copy
    of each: the head's weight gradient V*d*b and the hidden one N*d*b more at the head's peak,
    1.7 GiB for 152K x 4096 at 64K tokens.) Every gradient is computed; the loss is unscaled.
    A tensor `scale` [N] gives each token its own factor (the gradients of sum_t scale[t] x CE_t:
    a preference objective's second pass, each sequence's tokens scaled by its coefficient); the
    loss is still the plain sum. liger's kernel takes no such factor: the chunked torch one runs."""
    per_token = isinstance(scale, torch.Tensor)
    if per_token:
        if scale.numel() != labels.numel():
            raise ValueError(f"scale {tuple(scale.shape)} does not match labels {tuple(labels.shape)}")
        if impl == "fused" and hidden.is_cuda and _fused_backend() == "liger":
            impl = "chunked"
    if impl == "full" or (impl == "fused" and hidden.is_cuda and transform.is_identity
                          and _fused_backend() == "liger"):
        leaves = [t.detach().requires_grad_(True) for t in (hidden, weight)]
        b_leaf = bias.detach().requires_grad_(True) if bias is not None else None
        n_leaves = RowNorm(norm.fn, {k: p.detach().requires_grad_(True) for k, p in norm.params.items()}) \
            if norm is not None else None
        wrt = leaves + ([b_leaf] if b_leaf is not None else []) + (list(n_leaves.params.values()) if norm else [])
        with torch.enable_grad():
            if per_token:
                rows = _full_rows(_normed(leaves[0], n_leaves), leaves[1], labels.reshape(-1).long(), b_leaf, transform)
                loss, weighted = rows.sum(), (rows * scale.reshape(-1).to(rows.dtype)).sum()
            else:
                loss = linear_cross_entropy(leaves[0], leaves[1], labels, impl, chunk_tokens, b_leaf, transform,
                                            n_leaves)
                weighted = loss * scale
            grads = list(torch.autograd.grad(weighted, wrt))
        g_h, g_w = grads[0].view_as(hidden), grads[1]
        g_b = grads[2] if b_leaf is not None else None
        g_n = dict(zip(norm.params, grads[2 + (b_leaf is not None):])) if norm is not None else {}
        return loss.detach(), g_h, g_w, g_b, g_n
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).long()
    kernel = "torch" if impl == "chunked" or not transform.is_identity or not hidden.is_cuda else "triton"
    if kernel == "triton" and _fused_backend() is None:
        raise RuntimeError(f"impl='fused' needs CUDA tensors and Triton; available impls: {available_impls()}")
    names = list(norm.params) if norm is not None else []
    with torch.no_grad():             # as in a Function's forward: only the norm's chunks build graphs
        loss, g_h, g_w, g_b, *g_n = _chunked_loss_and_grads(flat_h, weight, bias, flat_y, chunk_tokens, kernel,
                                                           (True, True, True) + (True,) * len(names), transform,
                                                           norm, row_scale=scale.reshape(-1) if per_token else None)
        for g in (g_h, g_w, g_b, *g_n) if not per_token else ():     # in place: these tensors are ours alone
            if g is not None:
                _scale(g, scale, out=g)
    return loss, g_h.view_as(hidden), g_w, g_b, dict(zip(names, g_n))


def linear_token_losses(
    hidden: torch.Tensor,  # [N, d] compute dtype
    weight: torch.Tensor,  # [V, d]
    labels: torch.Tensor,  # [N] int64; -100 = ignored
    impl: str = "chunked",
    chunk_tokens: int = 4096,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = IDENTITY,
    norm: RowNorm | None = None,
) -> torch.Tensor:
    """Each token's cross-entropy [N] in the loss dtype (0 where ignored), the forward alone: no
    graph, no gradient, one chunk of logits at a time. A preference objective's first pass (a
    sequence's log-probability is minus the sum of its tokens'), whose coefficients then scale the
    second pass (linear_cross_entropy_grads with a per-token scale). Equal to the rows whose sum
    linear_cross_entropy returns, impl for impl ("full": F.cross_entropy over all logits)."""
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).long()
    with torch.no_grad():
        if impl == "full":
            return _full_rows(_normed(flat_h, norm), weight, flat_y, bias, transform)
        kernel = "triton" if impl == "fused" and flat_h.is_cuda and transform.is_identity \
            and _fused_backend() == "triton" else "torch"
        rows = torch.zeros(flat_y.shape, dtype=_loss_dtype(flat_h.dtype), device=flat_h.device)
        need = (False,) * (3 + (len(norm.params) if norm is not None else 0))
        _chunked_loss_and_grads(flat_h, weight, bias, flat_y, chunk_tokens, kernel, need, transform, norm,
                                row_losses=rows)
    return rows


def _normed(hidden: torch.Tensor, norm: RowNorm | None) -> torch.Tensor:
    """The norm over all tokens at once (autograd's graph), for the impls that do not chunk it."""
    return hidden if norm is None else norm.fn(hidden, norm.params)


# ---------------------------------------------------------------------------- full


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 when computing in float64 (so fp64 tests test fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _full(hidden, weight, labels, bias, transform=IDENTITY):
    logits = F.linear(hidden, weight, bias)  # [N, V] compute dtype
    return F.cross_entropy(
        transform.apply(logits.to(_loss_dtype(logits.dtype))), labels, ignore_index=IGNORE_INDEX, reduction="sum"
    )


def _full_rows(hidden, weight, labels, bias, transform=IDENTITY):
    """Each token's cross-entropy [N] through autograd over all logits (0 where ignored)."""
    logits = F.linear(hidden, weight, bias)  # [N, V] compute dtype
    return F.cross_entropy(
        transform.apply(logits.to(_loss_dtype(logits.dtype))), labels, ignore_index=IGNORE_INDEX, reduction="none"
    )


# ---------------------------------------------------------------------------- chunked


def _chunked(hidden, weight, labels, bias, chunk_tokens, kernel, transform=IDENTITY, norm: RowNorm | None = None):
    names = list(norm.params) if norm is not None else []
    if not torch.is_grad_enabled():  # a Function's forward can't see grad mode: decide here
        need = (False,) * (3 + len(names))
        return _chunked_loss_and_grads(hidden, weight, bias, labels, chunk_tokens, kernel, need, transform, norm)[0]
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, labels, chunk_tokens, kernel, transform,
                                            norm.fn if norm is not None else None, names,
                                            *(norm.params[n] for n in names))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Loss and all gradients in forward, chunk by chunk; backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_tokens, kernel, transform, norm_fn, norm_names, *norm_params):
        need = tuple(ctx.needs_input_grad[:3]) + tuple(ctx.needs_input_grad[9:])
        norm = RowNorm(norm_fn, dict(zip(norm_names, norm_params))) if norm_fn is not None else None
        loss, *grads = _chunked_loss_and_grads(hidden, weight, bias, labels, chunk_tokens, kernel, need, transform,
                                               norm)
        ctx.save_for_backward(*grads)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):  # grad_loss: 0-dim, the loss dtype
        # new tensors: backward may run again on a retained graph (gradcheck does)
        g_hidden, g_weight, g_bias, *g_norm = (None if g is None else _scale(g, grad_loss, out=torch.empty_like(g))
                                               for g in ctx.saved_tensors)
        return (g_hidden, g_weight, g_bias, None, None, None, None, None, None, *g_norm)


def _scale(g: torch.Tensor, s: torch.Tensor | float, out: torch.Tensor) -> torch.Tensor:
    """out = g * s, taken in the wider dtype and rounded once into out's dtype (out may be g).

    ``g_bf16 * s_fp32`` with a 0-dim s computes in bf16 on CUDA (s, often 1/tokens, is
    rounded to bf16 first: a bias of up to 0.4% on every gradient). A [1]-shaped s
    takes part in type promotion, so the multiply runs in fp32 on the fly.
    """
    if not isinstance(s, torch.Tensor):
        s = torch.tensor(s, dtype=_loss_dtype(g.dtype), device=g.device)
    return torch.mul(g, s.reshape(1), out=out)


@dataclass
class _ChunkGrads:
    """The gradients _chunked_loss_and_grads sums chunk by chunk, None where not needed."""

    need_h: bool
    need_w: bool
    need_b: bool
    need_n: list[bool]                  # each norm parameter's, in norm.params' order
    hidden: torch.Tensor | None         # [N, d]; rows of ignored tokens stay exactly zero
    weight: torch.Tensor | None         # [V, d]
    bias: torch.Tensor | None           # [V], the loss dtype
    norm_leaves: dict[str, torch.Tensor]   # the norm's parameters as leaves of each chunk's graph
    norm_wrt: list[torch.Tensor]        # those whose gradient is needed
    norm: list[torch.Tensor]            # their gradients, summed in the loss dtype
    need_x: bool                        # the chunk's input gradient, through the norm
    norm_grad: bool                     # the norm's backward runs on each chunk

    @property
    def any_grad(self) -> bool:
        return self.need_h or self.need_w or self.need_b or any(self.need_n)

    @classmethod
    def allocate(cls, hidden, weight, bias, need, norm: RowNorm | None, several_chunks: bool,
                 all_valid: bool) -> _ChunkGrads:
        need_h, need_w, need_b = need[:3]
        need_b = need_b and bias is not None
        norm_names = list(norm.params) if norm is not None else []
        need_n = list(need[3:3 + len(norm_names)]) if norm is not None else []
        acc = _loss_dtype(hidden.dtype)
        g_hidden = g_weight = g_bias = None
        if need_h:
            g_hidden = (torch.empty_like if all_valid else torch.zeros_like)(
                hidden, memory_format=torch.contiguous_format
            )  # [N, d]
        if need_w:
            # One chunk: a single matmul already accumulates in fp32 and rounds once.
            # Several: accumulate in fp32 so bf16 rounding does not pile up across chunks.
            g_weight = torch.zeros(weight.shape, dtype=acc if several_chunks else hidden.dtype, device=weight.device)
        if need_b:
            g_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device)
        # the norm's parameter gradients: autograd's on each chunk, summed in FP32
        norm_leaves = {name: p.detach().requires_grad_(need) for (name, p), need in
                       zip(norm.params.items(), need_n)} if norm is not None else {}
        norm_wrt = [norm_leaves[name] for name, need in zip(norm_names, need_n) if need]
        need_x = norm is not None and need_h
        return cls(need_h=need_h, need_w=need_w, need_b=need_b, need_n=need_n, hidden=g_hidden, weight=g_weight,
                   bias=g_bias, norm_leaves=norm_leaves, norm_wrt=norm_wrt,
                   norm=[torch.zeros(p.shape, dtype=acc, device=p.device) for p in norm_wrt],
                   need_x=need_x, norm_grad=need_x or bool(norm_wrt))

    def finished(self, weight, bias) -> tuple:
        """(grad_hidden, grad_weight, grad_bias, *grad of each norm parameter), each None where not
        needed, in its parameter's dtype."""
        grads_n = iter(g.to(p.dtype) for g, p in zip(self.norm, self.norm_wrt))
        g_norm_all = [next(grads_n) if need else None for need in self.need_n]
        g_weight = self.weight.to(weight.dtype) if self.weight is not None else None
        g_bias = self.bias.to(bias.dtype) if self.bias is not None else None
        return (self.hidden, g_weight, g_bias, *g_norm_all)


def _chunked_loss_and_grads(hidden, weight, bias, labels, chunk_tokens, kernel, need, transform=IDENTITY,
                            norm: RowNorm | None = None, row_scale: torch.Tensor | None = None,
                            row_losses: torch.Tensor | None = None):
    """(loss, grad_hidden | None, grad_weight | None, grad_bias | None, *grad of each norm parameter
    | None) for loss scale 1. need: whether each of hidden, weight, bias and the norm's parameters
    (in norm.params' order) needs its gradient. row_scale [N]: each token's factor on its
    gradients (the gradients of sum_t row_scale[t] x CE_t); row_losses [N]: filled with each
    token's CE (ignored tokens' entries are left as they are)."""
    n, acc = hidden.shape[0], _loss_dtype(hidden.dtype)
    if kernel == "torch":
        chunk_ce = functools.partial(_ce_chunk_torch, transform=transform)
    else:
        chunk_ce = _triton_ce_chunk()

    valid_idx = (labels != IGNORE_INDEX).nonzero().squeeze(1)  # [Nv]; syncs with the device
    n_valid = valid_idx.numel()
    all_valid = n_valid == n  # then chunks are slices (views), no gather copies
    n_chunks = -(-n_valid // chunk_tokens)

    loss = torch.zeros((), dtype=acc, device=hidden.device)
    g = _ChunkGrads.allocate(hidden, weight, bias, need, norm, several_chunks=n_chunks > 1, all_valid=all_valid)
    for start in range(0, n_valid, chunk_tokens):
        stop = min(start + chunk_tokens, n_valid)
        idx_c = None
        if all_valid:
            x_c, y_c = hidden[start:stop], labels[start:stop]  # [c, d], [c]
        else:
            idx_c = valid_idx[start:stop]
            x_c, y_c = hidden.index_select(0, idx_c), labels.index_select(0, idx_c)
        h_c, normed, x_leaf = _normed_chunk(x_c, norm, g)
        logits = F.linear(h_c, weight, bias)  # [c, V] compute dtype
        rows_c, g_logits = chunk_ce(logits, y_c, g.any_grad)  # [c]; g_logits reuses logits' memory
        del logits  # never two chunks of logits alive
        loss += rows_c.sum()
        if row_losses is not None:
            _put_rows(row_losses, rows_c, start, stop, idx_c)
        if not g.any_grad:
            continue
        if row_scale is not None:   # d/d logits of each row's share: rounded once into the buffer
            s_c = row_scale[start:stop] if all_valid else row_scale.index_select(0, idx_c)
            torch.mul(g_logits, s_c.to(acc)[:, None], out=g_logits)   # (in FP32 on the fly, as _scale)
        g_h_c = _logit_grads(g, g_logits, weight, h_c, acc, through_norm=normed is not None, all_valid=all_valid,
                             rows=slice(start, stop))
        del g_logits
        if normed is not None:
            g_h_c = _norm_backward(g, normed, x_leaf, g_h_c)
            del normed, x_leaf
        if g_h_c is not None and g.need_h:
            if all_valid:
                g.hidden[start:stop] = g_h_c
            else:
                g.hidden.index_copy_(0, idx_c, g_h_c)
        del g_h_c
    return (loss, *g.finished(weight, bias))


def _put_rows(out: torch.Tensor, rows_c: torch.Tensor, start: int, stop: int, idx_c: torch.Tensor | None) -> None:
    """Write a chunk's per-row values into out [N] at the chunk's tokens."""
    if idx_c is None:
        out[start:stop] = rows_c
    else:
        out.index_copy_(0, idx_c, rows_c.to(out.dtype))


def _normed_chunk(x_c: torch.Tensor, norm: RowNorm | None, g: _ChunkGrads):
    """(the head's input h_c [c, d], the norm's output with its graph when its backward runs, the
    graph's input leaf then): the chunk's rows x_c [c, d] through the norm, if any."""
    if norm is None:
        return x_c, None, None
    if g.norm_grad:
        with torch.enable_grad():
            x_leaf = x_c.detach().requires_grad_(g.need_x)
            normed = norm.fn(x_leaf, g.norm_leaves)                  # [c, d]
        return normed.detach(), normed, x_leaf
    return norm.fn(x_c, norm.params), None, None


def _logit_grads(g: _ChunkGrads, g_logits: torch.Tensor, weight: torch.Tensor, h_c: torch.Tensor, acc: torch.dtype,
                 through_norm: bool, all_valid: bool, rows: slice) -> torch.Tensor | None:
    """Add a chunk's weight and bias gradients from d loss / d logits [c, V]; return d loss / d h_c
    [c, d] where the norm's backward or a scatter still needs it, else write it straight into
    g.hidden[rows] (no norm to go through, no ignored rows) and return None."""
    g_h_c = None
    if g.need_h and not through_norm and all_valid:
        torch.mm(g_logits, weight, out=g.hidden[rows])
    elif g.need_h or through_norm:
        g_h_c = g_logits @ weight
    if g.need_w:
        _addmm_(g.weight, g_logits.t(), h_c)  # [V, d] += [V, c] @ [c, d]
    if g.need_b:
        g.bias += g_logits.sum(0, dtype=acc)
    return g_h_c


def _norm_backward(g: _ChunkGrads, normed: torch.Tensor, x_leaf: torch.Tensor,
                   g_h_c: torch.Tensor) -> torch.Tensor | None:
    """The norm's backward on a chunk: sums the norm's parameter gradients into g.norm and returns
    d loss / d x_c [c, d] (None where the input's gradient is not needed)."""
    got = torch.autograd.grad(normed, ([x_leaf] if g.need_x else []) + g.norm_wrt, g_h_c)
    for g_sum, g_p in zip(g.norm, got[1:] if g.need_x else got):
        g_sum.add_(g_p)
    return got[0] if g.need_x else None


def _ce_chunk_torch(logits: torch.Tensor, labels: torch.Tensor, compute_grad: bool,
                    transform: LogitTransform = IDENTITY):
    """(each row's fp32 CE [c], d loss / d logits in the logits dtype or None).

    The gradient is built in place over the fp32 upcast and copied back into the
    logits buffer: per chunk c*V*(b + 4) bytes, plus c*V*4 for tanh' with a softcap.
    """
    x = logits.to(_loss_dtype(logits.dtype))  # [c, V]; an alias when already fp32/fp64
    if not transform.is_identity and x.data_ptr() == logits.data_ptr():
        x = x.clone()  # the transform works in place; the logits buffer receives the gradient
    if transform.scale != 1.0:
        x.mul_(transform.scale)
    tanh_grad = None
    if transform.softcap:
        x.div_(transform.softcap).tanh_()  # t = tanh(z / c)
        if compute_grad:
            tanh_grad = 1.0 - x * x  # d(c * t) / dz = 1 - t^2  [c, V]
        x.mul_(transform.softcap)
    lse = torch.logsumexp(x, dim=1)  # [c]
    loss = lse - x.gather(1, labels[:, None]).squeeze(1)  # [c]
    if not compute_grad:
        return loss, None
    x.sub_(lse[:, None]).exp_()  # softmax
    x.scatter_add_(1, labels[:, None], x.new_full((labels.shape[0], 1), -1.0))  # - onehot
    if tanh_grad is not None:
        x.mul_(tanh_grad)
        del tanh_grad
    if transform.scale != 1.0:
        x.mul_(transform.scale)
    if x.data_ptr() != logits.data_ptr():
        logits.copy_(x)  # fp32 -> compute dtype, into the logits buffer
        del x
    return loss, logits


@functools.cache
def _triton_ce_chunk():
    from slidetune.ops.triton_ce import ce_chunk_inplace  # lazy: needs triton + CUDA

    return ce_chunk_inplace


def _addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, where acc may be fp32 and a, b bf16: accumulate without bf16 rounding."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif _has_out_dtype_addmm(acc.device.type):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)  # CUDA: fp32 result straight from the GEMM
    else:  # the product is rounded to the compute dtype once per chunk, then summed in fp32
        acc += a @ b


@functools.cache
def _has_out_dtype_addmm(device_type: str) -> bool:
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
        acc = torch.ones(2, 2, dtype=torch.float32, device=device_type)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return bool((acc == 3).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


# ---------------------------------------------------------------------------- fused


def auto_impl(device_type: str) -> str:
    """head_impl auto: fused on CUDA (faster and smaller than chunked, the figures above) where its
    kernel can run, chunked elsewhere. Planning for a GPU from a machine without one takes the GPU
    to have Triton (every CUDA build of torch on Linux ships it)."""
    if device_type != "cuda":
        return "chunked"
    if torch.cuda.is_available() and _fused_backend() is None:
        return "chunked"
    return "fused"


@functools.cache
def _fused_backend() -> str | None:
    """"triton" (this module's kernel, the one measured above) if Triton is installed, else
    "liger" if liger-kernel imports; CUDA required. Triton first: liger-kernel may be installed for
    the lean layer's kernels (models/lean_layer.py) without changing the head's."""
    if not torch.cuda.is_available():
        return None
    if importlib.util.find_spec("triton") is not None:
        return "triton"
    if _liger_fn() is not None:
        return "liger"
    return None


@functools.cache
def _liger_fn():
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception:  # not installed, or broken against this torch/triton
        return None
    return liger_fused_linear_cross_entropy


def _liger(hidden, weight, labels, bias):
    valid_idx = (labels != IGNORE_INDEX).nonzero().squeeze(1)
    if valid_idx.numel() == 0:  # nothing to compute; keeps the graph connected
        return _chunked(hidden, weight, labels, bias, 1, kernel="torch")
    if valid_idx.numel() < labels.numel():  # ignored rows never reach the kernel
        hidden, labels = hidden.index_select(0, valid_idx), labels.index_select(0, valid_idx)
    out = _liger_fn()(hidden, weight, labels, bias=bias, ignore_index=IGNORE_INDEX, reduction="sum")
    loss = out[0] if isinstance(out, tuple) else getattr(out, "loss", out)
    return loss.to(_loss_dtype(hidden.dtype))
