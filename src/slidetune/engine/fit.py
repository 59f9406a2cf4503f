"""Will it fit? Host RAM, pinned memory and GPU memory of a configuration, before allocating.

    est = estimate_memory(split, rt, batch_size=16, seq_len=1024)    # itemized bytes
    check_fit(split, rt, batch_size=16, seq_len=1024)                 # or InsufficientMemoryError

The estimate is arithmetic over the skeleton's shapes (no tensor is allocated), so
it runs in milliseconds for any model size, including on a machine without a GPU
(`rt.device="cuda"` plans for one). When a configuration does not fit, the error
lists changes that DO fit, each found by re-running the same estimate (a smaller
batch found by bisection, offloaded checkpoints, fewer slots, a smaller head chunk,
another mode).

Notation: P parameters, P_L the largest decoder layer, P_E / P_H the embedding and
head units, b bytes per element of the compute dtype (2 for bf16), N = B*S tokens per
micro-batch, L layers, d hidden width, V vocabulary, I the MLP width.

What each engine allocates (see slide/engine.py and plain.py):
  slide  GPU : K layer slots + G gradient slots of P_L*b each, dedicated embed/head weight
               and gradient slots ((P_E+P_H)*b each), layer-input checkpoints (L*A*N*d*b on
               the GPU for A micro-batches, run layer by layer; with --offload-activations
               A*N*d*b for each kept there by gpu_checkpoints, plus those in flight), plus the
               largest of the transient working sets (one micro-batch's recompute + backward
               of a layer, the head, the embedding backward).
         host: 12 B/param (FP32 master + two moments: adamw.FP32_ADAMW), + the compute dtype's size (2 B/param for
               BF16) with the deferred schedule (clipping): the held gradients, page-locked;
               disk units (the disk tier) 4 B/param (the master), or b with their master on disk
               too (the compute-dtype weights the uploads copy, page-locked), + its block buffers;
               pinned upload/download rings of chunk_mb each, one FP32 scratch chunk, and with
               offload A*N*d*b pinned for each offloaded checkpoint.
  gpu/ckpt   : per param FP32 master 4 + moments 8 + FP32 grad 4 + compute copy b + compute
               grad b, all on the device; full saved activations for layers that are not
               recomputed, an N*d*b checkpoint for those that are.
On device "cpu" the "GPU" parts live in host RAM and are checked against it.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field

import torch

from ..models.units import SplitModel
from .adamw import FP32_ADAMW, optimizer_state
from .config import RuntimeConfig, cli_flag, recompute_set
from .placement import DISK_BUFFERS_UNRESOLVED, PlacementPlan, cache_unit_options, unit_shapes
from .slide.disk_tier import buffer_bytes, check_directory, tier_blocks, tier_bytes
from .slide.host_store import BUILD_WORKERS

GiB = 2**30
# The share of the GPU's free memory and of the host's available RAM a run plans to use (the rest:
# fragmentation, the allocator's caching, other processes' growth). Against the H200's runs of
# Qwen3-8B under a 24 GiB budget (NOTES.md "Memory fit margins"): the GPU estimate, which carries its own margins
# (CUDA_OVERHEAD_BYTES, ACTIVATION_MARGIN, HEAD_MARGIN), was 1.17x the allocator's reserved peak at
# b16 (21.46 vs 18.38 GiB); the host estimate was within 1% of the process's RSS (b16 110.1 vs
# 110.0 GiB; b32 with the lean layer 114.3 vs 115.5). 0.95 leaves 6 GiB of a 123 GiB host and
# 1.2 GiB of a 24 GiB GPU for what the estimate misses.
FIT_SAFETY = 0.95
MiB = 2**20


def free_memory_needed(estimate_bytes: int, safety: float = FIT_SAFETY) -> float:
    """The free memory (GPU or host) an estimate of `estimate_bytes` fits in: check_fit lets a run
    use `safety` of what is free (_Budget.shortfalls)."""
    return estimate_bytes / safety

# CUDA context + allocator slack. mem_get_info() is read after the context exists, but
# cuBLAS handles and workspaces, kernel modules loaded lazily during the first steps,
# and the caching allocator's rounding and fragmentation (blocks come from 2 MiB /
# 20 MiB pools; a freed logits chunk is not always reused exactly) come later. 1 GiB is
# a round allowance for these, not a measurement: compare it with a run's
# max_memory_reserved - max_memory_allocated on the GPU before you tighten it.
CUDA_OVERHEAD_BYTES = 1 * GiB
# Host memory that appears after the check: with CUDA, the driver's host-side state
# and pinned staging of the caching host allocator (~0.3-0.6 GB RSS), plus tokenizer,
# data pipeline and Python objects. On a CPU-only run only the latter.
HOST_OVERHEAD_BYTES = {"cuda": 1 * GiB, "cpu": GiB // 2}
# Multiplier on activation estimates: layer_activation_bytes counts the tensors autograd
# saves and the main gradients alive at the peak of backward; 10% covers what it leaves
# out (small fp32 reductions, the allocator rounding every tensor up to 512 B / 2 MiB
# blocks, kernel workspaces). Against the allocator's peak of a real Llama / Qwen3 layer
# on the CPU (fp32 and bf16, 16 to 4096 tokens, padded or not; tests/test_fit.py), the
# estimate with this margin is 1.00-1.33x the measured peak, without it 0.91-1.21x.
ACTIVATION_MARGIN = 1.10
# The head's estimate (head_bytes) matches the CPU allocator's peak within 0-3% for full
# and chunked, fp32 and bf16 (tests/test_fit.py) and the H100 numbers of
# ops/cross_entropy.py within 1%; 5% for cuBLAS workspaces and allocator rounding.
HEAD_MARGIN = 1.05
ENV_HOST_MEMORY = "SLIDETUNE_HOST_MEMORY_BYTES"


# ----------------------------------------------------------------------------- results


# host parts held once per host under data parallel (the shared state; the owners' held gradients;
# the disk tier, which local rank 0 alone keeps)
SHARED_PER_HOST = ("master + Adam moments", "held gradients", "disk units' masters", "disk tier block buffers")


@dataclass
class MemoryEstimate:
    """Bytes a configuration needs. host_bytes includes pinned_bytes (pinned is a part of RAM)."""

    gpu_bytes: int
    host_bytes: int
    pinned_bytes: int
    gpu_parts: dict[str, int]            # sums to gpu_bytes: persistent buffers + the peak phase
    host_parts: dict[str, int]           # sums to host_bytes
    device_type: str = "cuda"            # "cpu": gpu_* is memory of the CPU device, i.e. host RAM
    phases: dict[str, int] = field(default_factory=dict)  # transient working sets; only the largest counts
    schedule: str | None = None          # slide mode: eager | deferred
    disk_bytes: int = 0                  # the disk tier's files (slide mode with disk units)
    plan: PlacementPlan | None = None    # slide mode: the placement the estimate is of

    @property
    def host_total_bytes(self) -> int:
        """What the host must hold: on device cpu the device parts live in RAM too."""
        return self.host_bytes + (self.gpu_bytes if self.device_type == "cpu" else 0)

    def host_bytes_per_host(self, ranks_per_host: int = 1) -> int:
        """What the host must hold with `ranks_per_host` data-parallel ranks on it: the state
        (master + moments) and the held gradients once (one shared copy; each owner holds its own
        units' gradients), everything else (rings, checkpoints, on device cpu the device parts) once
        per rank (docs/data_parallel.md)."""
        once = sum(v for k, v in self.host_parts.items() if k.startswith(SHARED_PER_HOST))
        return once + ranks_per_host * (self.host_total_bytes - once)

    def summary(self) -> str:
        def items(parts):
            return ", ".join(f"{k} {_gib(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v)
        dev = "GPU" if self.device_type == "cuda" else "device (cpu: in RAM)"
        return (f"{dev} {_gib(self.gpu_bytes)} GiB [{items(self.gpu_parts)}]; host {_gib(self.host_bytes)} GiB "
                f"(pinned {_gib(self.pinned_bytes)}) [{items(self.host_parts)}]"
                + (f"; disk tier {_gib(self.disk_bytes)} GiB" if self.disk_bytes else ""))


class InsufficientMemoryError(RuntimeError):
    """The configuration does not fit; the message has the numbers and options that would."""

    def __init__(self, message: str, estimate: MemoryEstimate | None = None, options: list[str] | None = None):
        super().__init__(message)
        self.estimate = estimate
        self.options = options or []


# ----------------------------------------------------------------------------- shapes


@dataclass
class _Shape:
    d: int            # hidden width
    inter: int        # MLP width I
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    qk_norm: bool     # per-head q/k RMSNorms (Qwen3)
    mask_types: int   # distinct attention-mask kinds (full, sliding window)
    sliding_window: int | None = None   # window of the sliding-attention layers, if any

    @property
    def hq(self) -> int:
        return self.heads * self.head_dim

    @property
    def hk(self) -> int:
        return self.kv_heads * self.head_dim


def _shape(split: SplitModel) -> _Shape:
    c = split.config
    d = int(c.hidden_size)
    heads = int(c.num_attention_heads)
    kv = int(getattr(c, "num_key_value_heads", None) or heads)
    hd = int(getattr(c, "head_dim", None) or d // heads)
    inter = getattr(c, "intermediate_size", None)
    if inter is None:  # derive from the layer's size: 3 d*I MLP matrices beside attention
        attn = d * heads * hd * 2 + d * kv * hd * 2
        inter = max(1, (max(u.numel for u in split.layer_units) - attn) // (3 * d))
    names = {p.local_name for p in split.layer_units[0].params} if split.layer_units else set()
    qk_norm = any("q_norm" in n for n in names)
    types = getattr(c, "layer_types", None)
    window = getattr(c, "sliding_window", None)
    # a window applies where layer_types names sliding layers, or (no layer_types: Mistral) to every layer
    sliding = ("sliding_attention" in types) if types else window is not None
    return _Shape(d=d, inter=int(inter), heads=heads, kv_heads=kv, head_dim=hd, vocab=int(c.vocab_size),
                  layers=split.num_layers, qk_norm=qk_norm, mask_types=max(1, len(set(types or []))),
                  sliding_window=int(window) if sliding and window else None)


def materialized_masks(split: SplitModel, seq_len: int, padded: bool) -> int:
    """How many [B,1,S,S] attention masks HF builds for a batch (SDPA): one per mask kind when the
    batch may carry padding; without padding none for causal attention (SDPA's is_causal), one
    for sliding-window layers whose window is shorter than the sequence (checked against HF in
    tests/test_fit.py)."""
    sh = _shape(split)
    if padded:
        return sh.mask_types
    return 1 if sh.sliding_window is not None and seq_len > sh.sliding_window else 0


def _device_type(rt: RuntimeConfig) -> str:
    if rt.device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(rt.device).type


# ----------------------------------------------------------------------------- activations


def _math_attention(dtype: torch.dtype) -> bool:
    """Whether SDPA falls back to its math path (B*heads*S*S scores in memory).

    Not for the compute dtypes the runtime offers. On the CPU, torch's flash kernel takes
    fp32, bf16 and fp16 (measured, tests/test_fit.py: one layer's peak is the same at
    4 x 256 and 2 x 512 tokens, i.e. no S^2 term, padded or not). On CUDA, torch's kernel
    selection gives bf16/fp16 flash or memory-efficient attention and fp32 the
    memory-efficient kernel, also with a padding mask (not measured here). Other dtypes
    (float64) take the math path. Pass math_attention=True to layer_activation_bytes to
    see the S^2 cost where a fused kernel is unavailable.
    """
    return dtype not in (torch.float32, torch.bfloat16, torch.float16)


def layer_activation_bytes(split: SplitModel, batch_size: int, seq_len: int, dtype: torch.dtype,
                           math_attention: bool | None = None, masked: bool = True) -> dict[str, int]:
    """Working set of ONE decoder layer run with autograd, then differentiated (no margin).

    Returns bytes for N = batch_size * seq_len tokens:
      "saved"       tensors autograd keeps from forward to backward;
      "peak"        the peak of forward + backward above the layer's input and weights,
                    counting the layer's parameter gradients as fresh tensors (slide mode:
                    autograd.grad returns them before they are copied into a grad slot);
      "peak_no_param_grads"  the same with the parameter gradients left out (plain modes
                    count them in their per-parameter bytes).

    Saved, per token, b = compute-dtype bytes, for a Llama-style layer
    (RMSNorm -> q,k,v -> rotary -> SDPA -> o_proj -> +res -> RMSNorm -> SwiGLU MLP -> +res),
    read off what each op saves for backward (checked with saved_tensors_hooks):
      each RMSNorm (x2): its input upcast to fp32 (4d; in fp32 the input itself) saved by
          pow/mul, the normalized value (b*d) saved by `weight * h`, and the weighted output
          (b*d) saved by the q/k/v (resp. gate/up) projections as their input:   2*(4 + 2b)*d
      q/k RMSNorm (Qwen3): fp32 input + normalized per element:                 (4 + b)*(hq + hk)
      rotary: q*cos + rot(q)*sin saves only cos/sin (no grad), shared by all layers:   ~0
      SDPA (flash / memory-efficient): q, k, v, output, logsumexp (fp32 per head);
          o_proj's input is a view of the output (the kernels write [B,S,h,hd]).
          k and v count at q's width: with a padding mask HF repeats k/v to every head
          (repeat_kv) instead of using enable_gqa:                             4*b*hq + 4*heads
          a padding mask is converted to the compute dtype inside SDPA and saved per layer
          (B*S*S*b per layer; counted where the layer gets a mask, `masked`):  b*S
      SwiGLU: gate (SiLU input), act (mul input), up (mul input), act*up (down_proj input):
                                                                              4*b*I
      residual adds save nothing.
    Backward goes from the MLP down; saved tensors are freed as it goes while the
    parameter gradients appear, so the peak is the largest of three moments:
      1. MLP start: everything saved + the two gradients of act*up alive at once (2*b*I)
         + the layer output, its gradient and the input gradient (3*b*d)
         + the first weight gradient (down_proj, b*d*I);
      2. attention: saved minus the MLP's (4*b*I) + dq, dk, dv at q's width (3*b*hq)
         + fp32 temporaries of the norm backward (8d) + 3*b*d + the MLP's weight
         gradients (b*3*d*I);
      3. end: all parameter gradients (b*P_L) + 3*b*d.
    The math path of SDPA (see _math_attention) adds the saved probabilities b*heads*S
    and, transiently, scores and both their gradients 3*b*heads*S.
    """
    sh = _shape(split)
    if math_attention is None:
        math_attention = _math_attention(dtype)
    b = torch.empty((), dtype=dtype).element_size()
    d, inter, hq, hk, heads, S = sh.d, sh.inter, sh.hq, sh.hk, sh.heads, seq_len
    N = batch_size * seq_len
    saved = 2 * (4 + 2 * b) * d                                  # two RMSNorms
    if sh.qk_norm:
        saved += (4 + b) * (hq + hk)
    saved += b * 4 * hq + 4 * heads                              # q, k, v (repeated), out, lse
    if masked:
        saved += b * S                                           # the mask's copy inside SDPA
    saved_mlp = 4 * b * inter                                    # gate, act, up, act*up
    saved += saved_mlp
    io = 3 * b * d
    bw_mlp = 2 * b * inter + io
    bw_attn = 3 * b * hq + 8 * d + io
    if math_attention:
        saved += b * heads * S
        bw_attn += 3 * b * heads * S
    p_layer = max((u.numel for u in split.layer_units), default=0)
    p_mlp = min(3 * d * inter, p_layer)
    phases = [(N * (saved + bw_mlp), b * d * inter),
              (N * (saved - saved_mlp + bw_attn), b * p_mlp),
              (N * io, b * p_layer)]
    # Kernel scratch beyond the tensors above: torch 2.13's CPU BF16 GEMMs took 63 KiB more than
    # the formula at 16 tokens of a 256-wide layer (tests/test_fit.py); nothing at GPU sizes.
    workspace = 128 * 2**10
    return {"saved": N * saved,
            "peak": max(a + g for a, g in phases) + workspace,
            "peak_no_param_grads": max(a for a, _ in phases) + workspace}


def lean_layer_bytes(split: SplitModel, batch_size: int, seq_len: int, dtype: torch.dtype, tile_tokens: int,
                     masked: bool = True) -> dict[str, int]:
    """layer_activation_bytes for the lean layer (models/lean_layer.py): its recompute + backward,
    the same keys. Per token, b = compute-dtype bytes (d, hq, hk: hidden, query and key widths):
      the attention half's saved tensors (the lean RMSNorm saves only its input, alive anyway, and
          1/rms): the normed input (q/k/v's input) b*d; rotated q and k, v (SDPA's inputs), SDPA's
          output and its transposed copy (o_proj's input) b*(3 hq + 2 hk); Qwen3's per-head norms
          keep the q/k projections b*(hq + hk); the logsumexp 4*heads; with a padding mask k and v
          repeated to q's width (HF's repeat_kv), and the mask's copy b*S;
      the residual stream between the halves: h and its gradient (the output gradient, consumed
          in place), 2 b*d;
      the attention backward's transients: the gradients of o_proj's input, SDPA's output and
          inputs and rotary's temporaries b*(5 hq + 2 hk), flash attention's FP32 dq accumulator
          4*hq, the normed input's gradient b*d.
    Two phases; the peak is the larger:
      MLP tiles: the attention half's saved tensors and the stream for all tokens, plus one tile
          (T = min(tile_tokens, N) tokens) of HF's MLP run with autograd (norm output, gate, up,
          act, act*up saved; two I-wide gradients and 3 d-wide at once), the tiles' FP32 weight-
          gradient sums and one tile's compute-dtype weight gradients (6 B a MLP parameter);
      attention backward: saved + stream + transients for all tokens, the MLP's gradients (b).
    Against the H200 (benchmarks/results/lean_layer/, NOTES.md "Lean layer"; tests/test_fit.py): 7.9 GiB for
    Llama-3.1-8B at 1 x 65536 (measured 7.14), 8.5 for Qwen3-8B at 64 x 1024 (7.62), 3.2 at 16 x 1024
    (2.75): 11-16% above, on the safe side, before ACTIVATION_MARGIN."""
    sh = _shape(split)
    b = torch.empty((), dtype=dtype).element_size()
    d, inter, hq, hk, heads, S = sh.d, sh.inter, sh.hq, sh.hk, sh.heads, seq_len
    N = batch_size * seq_len
    kv = hq if masked else hk                                   # repeat_kv under a padding mask
    saved = b * (d + 3 * hq + 2 * kv) + 4 * heads
    if sh.qk_norm:
        saved += b * (hq + hk)
    if masked:
        saved += b * S
    stream = 2 * b * d
    transients = b * (5 * hq + 2 * kv) + 4 * hq + b * d
    p_layer = max((u.numel for u in split.layer_units), default=0)
    p_mlp = min(3 * d * inter, p_layer)
    T = min(tile_tokens, N)
    tile = T * (b * d + 4 * b * inter + 2 * b * inter + 3 * b * d)
    mlp_grads = (4 if N > T else 0) * p_mlp + b * p_mlp
    phases = [(N * (saved + stream) + tile, mlp_grads),
              (N * (saved + stream + transients), b * p_layer)]
    workspace = 128 * 2**10                                     # as in layer_activation_bytes
    return {"saved": N * saved,
            "peak": max(a + g for a, g in phases) + workspace,
            "peak_no_param_grads": max(a for a, _ in phases) + workspace}


def lean_row_tiled_bytes(split: SplitModel, batch_size: int, seq_len: int, dtype: torch.dtype, tile_tokens: int,
                         row_tokens: int, masked: bool = True) -> dict[str, int]:
    """lean_layer_bytes over row tiles of R = max(1, row_tokens // seq_len) sequences
    (models/lean_layer.LeanLayers._row_tiles; row_tokens 0: none): one tile's working set, plus
    what spans every row: the output gradient and the input gradient being filled (2 b*N*d) and
    the FP32 sums of the layer's weight gradients (4 B a parameter). One tile: untiled. (Packed
    documents' FlexAttention mask is cut with the rows: ops/packed_attention.block_mask_rows.)"""
    rows = max(1, row_tokens // max(seq_len, 1)) if row_tokens else batch_size
    if rows >= batch_size:
        return lean_layer_bytes(split, batch_size, seq_len, dtype, tile_tokens, masked=masked)
    tile = lean_layer_bytes(split, rows, seq_len, dtype, tile_tokens, masked=masked)
    b = torch.empty((), dtype=dtype).element_size()
    spans = 2 * b * batch_size * seq_len * _shape(split).d + 4 * max((u.numel for u in split.layer_units), default=0)
    return {"saved": tile["saved"], "peak": tile["peak"] + spans,
            "peak_no_param_grads": tile["peak_no_param_grads"] + spans}


def _working_set_margin(split: SplitModel, rt: RuntimeConfig) -> float:
    """The margin on one layer's working set: ACTIVATION_MARGIN on HF's layer (a count of saved
    tensors); none on the lean layer's, whose count is fitted to the H200's measured peaks and sits
    11-16% above them (lean_layer_bytes)."""
    from .slide.layer_runner import resolve_lean_layer
    return 1.0 if resolve_lean_layer(split, rt) == "on" else ACTIVATION_MARGIN


def working_set_bytes(split: SplitModel, rt: RuntimeConfig, batch_size: int, seq_len: int, dtype: torch.dtype,
                      masked: bool) -> dict[str, int]:
    """One layer's recompute + backward as the slide engine runs it: the lean layer's where the
    runtime resolves it on (engine/slide/layer_runner.resolve_lean_layer), else HF's."""
    from .slide.layer_runner import resolve_lean_layer
    if resolve_lean_layer(split, rt) == "on":
        return lean_row_tiled_bytes(split, batch_size, seq_len, dtype, rt.layer.mlp_tile_tokens,
                                    rt.layer.layer_row_tokens, masked=masked)
    return layer_activation_bytes(split, batch_size, seq_len, dtype, masked=masked)


def head_bytes(split: SplitModel, n_tokens: int, dtype: torch.dtype, impl: str, chunk_tokens: int,
               grads_in_place: bool = False) -> int:
    """Peak of the output layer's loss + gradients, for n_tokens (all assumed not ignored), the final
    norm included; the head's input (the last layer's output, N*d*b) counted.

    full   : HF's norm over all tokens, its FP32 upcast and saved output ((4 + 2b)*N*d); the
             logits N*V*b (kept alive by the caller), their fp32 upcast (an alias in fp32) and
             the log_softmax output (4 each); backward: the log_softmax output, its gradient
             and the input gradient in fp32 (4 each): 12*N*V at the peak (measured on the CPU
             for bf16 and fp32: 12.1*N*V); plus the weight gradient V*d*b and the hidden
             gradient N*d*b.
    chunked: the norm inside the chunks (ops/cross_entropy.py): per chunk of c = min(chunk_tokens,
             N) tokens the norm's graph (FP32 upcast and products, (24 + 4b)*c*d with its
             backward), the logits c*V*b, their fp32 upcast (4, an alias in fp32) and
             logsumexp's fp32 temporary (4), the chunk's hidden gradient c*d*b; an fp32
             weight-gradient accumulator 4*V*d when there is more than one chunk (rounded into
             V*d*b after the loop); the input gradient N*d*b. Through autograd, backward scales
             the gradients into new tensors (V*d*b + N*d*b more); the engine's path
             (grads_in_place: models/units.head_loss_and_grads) scales them in place.
             Peak = max(loop, final rounding, scaling).
    fused  : our Triton kernel writes the gradient in place over a chunk's logits: c*V*b, no
             fp32 copy; liger-kernel's (where Triton alone does not import) upcasts its chunks
             and norms outside them, counted as chunked's with c*V*(b + 4).
    Against the CPU allocator (tests/test_fit.py) and the H100 figures in ops/cross_entropy.py.
    """
    sh = _shape(split)
    b = torch.empty((), dtype=dtype).element_size()
    V, d, N = sh.vocab, sh.d, n_tokens
    x = N * d * b                                           # the head's input
    if impl == "full":
        norm = (4 + 2 * b) * N * d
        return x + norm + (8 + max(b, 4)) * N * V + V * d * b + N * d * b
    c = max(1, min(chunk_tokens, N))
    chunks = -(-N // c)
    liger = impl == "fused" and _fused_head_backend() == "liger"
    if impl == "fused":
        per_chunk = c * V * (b + 4 if liger else b)
    else:
        per_chunk = c * V * (b + 4 + (0 if b >= 4 else 4))
    norm_chunk = (24 + 4 * b) * c * d + c * d * b           # the chunk's norm graph, its hidden gradient
    if liger:                                               # the norm over all tokens, outside the kernel
        norm_chunk = (4 + 2 * b) * N * d
    acc = 4 * V * d if chunks > 1 else b * V * d
    g_x = N * d * b
    loop = per_chunk + norm_chunk + acc + g_x
    final = acc + (b * V * d if chunks > 1 else 0) + g_x
    scaling = (1 if grads_in_place else 2) * (b * V * d + g_x)
    return x + max(loop, final, scaling)


def _fused_head_backend() -> str | None:
    """The fused head's kernel on this machine; None on a machine without CUDA (planning for a
    GPU from elsewhere: every CUDA build of torch on Linux ships Triton, ops/cross_entropy.auto_impl)."""
    from ..ops.cross_entropy import _fused_backend
    return _fused_backend()


# ----------------------------------------------------------------------------- the estimate


def summing_bytes(grad_sum: str, micro_batches: int, params: int) -> int:
    """Device bytes one layer's micro-batch gradient sum holds (engine/slide/grad_sum.py's rule);
    auto, resolved on the GPU machine, counts the larger of its two ways."""
    from .slide.grad_sum import accumulation_bytes
    ways = ("torch", "fused") if grad_sum == "auto" else (grad_sum,)
    return max(accumulation_bytes(w, micro_batches, params) for w in ways)


@dataclass
class _Work:
    """What one estimate is of: the device, the compute dtype, the batch and the model's sizes."""

    dev: str                    # cuda | cpu
    dtype: torch.dtype
    b: int                      # bytes per element of the compute dtype
    B: int                      # sequences per micro-batch
    S: int                      # tokens per sequence
    N: int                      # tokens per micro-batch, B * S
    # slide mode runs a step's micro-batches layer by layer: the checkpoints, the head and the
    # embedding backward see every micro-batch's tokens at once, a layer's working set one's
    N_step: int                 # tokens per step, N * grad_accum
    grad_accum: int
    L: int                      # decoder layers
    d: int                      # hidden width
    P: int                      # parameters of the whole model
    P_L: int                    # parameters of the largest decoder layer
    P_E: int                    # parameters of the embedding unit
    P_H: int                    # parameters of the head unit
    largest_param: int          # elements of the largest single parameter
    masks: int                  # [B,1,S,S] masks HF materializes (materialized_masks)
    layer_inputs: int           # bytes every layer receives besides the hidden states
    head: int                   # bytes of the head phase

    @property
    def ckpt_micro(self) -> int:
        """One micro-batch's checkpoint of one layer: [B, S, d] in the compute dtype."""
        return self.N * self.d * self.b

    @property
    def ckpt(self) -> int:
        """A layer's checkpoints, every micro-batch: [grad_accum * B, S, d]."""
        return self.N_step * self.d * self.b


@dataclass
class _Parts:
    """The estimate's terms as they are gathered (insertion order is the order they print in)."""

    gpu: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    phases: dict[str, int] = field(default_factory=dict)
    pinned: int = 0
    disk_bytes: int = 0


def _work(split: SplitModel, rt: RuntimeConfig, batch_size: int, seq_len: int, grad_accum: int,
          padded: bool) -> _Work:
    dtype = rt.torch_dtype
    b = torch.empty((), dtype=dtype).element_size()
    sh = _shape(split)
    B, S, N = batch_size, seq_len, batch_size * seq_len
    # what every layer receives besides the hidden states: the [B,1,S,S] bool masks HF
    # materializes (materialized_masks), rotary cos/sin [1,S,hd] fp32
    masks = materialized_masks(split, S, padded)
    layer_inputs = masks * B * S * S + 2 * S * sh.head_dim * 4 + 2 * N * 8   # + ids, labels
    # slide mode's head computes its gradients without autograd, scaled in place (engine/slide)
    head = int(HEAD_MARGIN * head_bytes(split, N, dtype, rt.resolved_head_impl, rt.head.head_chunk_tokens,
                                        grads_in_place=rt.mode == "slide"))
    return _Work(dev=_device_type(rt), dtype=dtype, b=b, B=B, S=S, N=N, N_step=N * grad_accum,
                 grad_accum=grad_accum, L=sh.layers, d=sh.d, P=split.num_params(),
                 P_L=max((u.numel for u in split.layer_units), default=0),
                 P_E=split.embed_unit.numel, P_H=split.head_unit.numel,
                 largest_param=max(p.numel for u in split.units for p in u.params),
                 masks=masks, layer_inputs=layer_inputs, head=head)


def estimate_memory(split: SplitModel, rt: RuntimeConfig, *, batch_size: int, seq_len: int,
                    grad_accum: int = 1, max_grad_norm: float | None = None, padded: bool = True,
                    ranks_per_host: int = 1) -> MemoryEstimate:
    """Bytes of GPU, host and pinned memory the configuration needs (nothing is allocated).

    padded: whether batches may carry padding (then HF materializes [B,1,S,S] masks, which SDPA
    also copies per layer: the S^2 terms of long sequences). Packed data and synthetic benchmark
    batches have none; the default assumes they may.
    ranks_per_host: data parallel's ranks on each host; the GPU bytes are one rank's (the busiest,
    where shard_layers spread layers over the host's GPUs), the host bytes one rank's too
    (MemoryEstimate.host_bytes_per_host counts the host)."""
    if batch_size < 1 or seq_len < 1 or grad_accum < 1:
        raise ValueError("batch_size, seq_len and grad_accum must be >= 1")
    w = _work(split, rt, batch_size, seq_len, grad_accum, padded)
    parts = _Parts()
    schedule = plan = None
    if rt.mode == "slide":
        schedule = rt.resolved_schedule(grad_accum, max_grad_norm)
        plan = PlacementPlan.build(unit_shapes(split), rt, schedule, ranks=ranks_per_host)
        _slide_terms(parts, split, rt, w, schedule, plan)
    else:
        _whole_model_terms(parts, split, rt, w)
    peak_name = max(parts.phases, key=parts.phases.get)
    parts.gpu[f"{peak_name} (peak phase)"] = parts.phases[peak_name]
    if w.dev == "cuda":
        parts.gpu["cuda context + allocator slack"] = CUDA_OVERHEAD_BYTES
    parts.host["runtime overhead"] = HOST_OVERHEAD_BYTES[w.dev if w.dev in HOST_OVERHEAD_BYTES else "cuda"]
    return MemoryEstimate(gpu_bytes=int(sum(parts.gpu.values())), host_bytes=int(sum(parts.host.values())),
                          pinned_bytes=int(parts.pinned), gpu_parts={k: int(v) for k, v in parts.gpu.items()},
                          host_parts={k: int(v) for k, v in parts.host.items()}, device_type=w.dev,
                          phases={k: int(v) for k, v in parts.phases.items()}, schedule=schedule,
                          disk_bytes=int(parts.disk_bytes), plan=plan)


def _whole_model_terms(parts: _Parts, split: SplitModel, rt: RuntimeConfig, w: _Work) -> None:
    """gpu and ckpt modes: the whole model, its optimizer state and its activations on the device."""
    gpu = parts.gpu
    P, N, d, b, L = w.P, w.N, w.d, w.b, w.L
    recomputed = rt.recomputed_layers(L)
    gpu["fp32 master"] = FP32_ADAMW.master_bytes * P
    gpu["Adam moments"] = FP32_ADAMW.moment_bytes * P
    gpu["fp32 grad accumulator"] = 4 * P
    gpu["compute weights"] = b * P
    gpu["compute grads"] = b * P
    stored = len(recomputed) * N * d * b
    act = layer_activation_bytes(split, w.B, w.S, w.dtype, masked=w.masks > 0)
    stored += (L - len(recomputed)) * int(ACTIVATION_MARGIN * act["saved"])
    gpu["stored activations"] = stored
    gpu["layer inputs (masks, rotary, ids)"] = w.layer_inputs
    # backward of one layer above what is stored: its whole working set when it is
    # recomputed, only the backward temporaries when its activations are stored
    bwd = int(ACTIVATION_MARGIN * (act["peak_no_param_grads"] - (0 if recomputed else act["saved"])))
    parts.phases = {"layer working set": bwd, "head/logits": w.head}
    if w.dev == "cuda":  # each unit is built in host RAM, then copied to the device
        parts.host["weight loading transient"] = max(u.numel for u in split.units) * 4


def _grad_slot_bytes(plan: PlacementPlan, b: int) -> int:
    """Bytes per element of the gradient slots: FP32, or the compute dtype's b."""
    return 4 if plan.grad_slots_fp32 else b


def _device_layer_params(split: SplitModel, plan: PlacementPlan) -> int:
    return sum(u.numel for u in split.layer_units[:plan.device_layers])


def _slide_terms(parts: _Parts, split: SplitModel, rt: RuntimeConfig, w: _Work, schedule: str,
                 plan: PlacementPlan) -> None:
    """slide mode: the window's GPU buffers, the GPU-updated units, the host's state and buffers."""
    if w.grad_accum > 1:
        # a micro-batch at a time, its parameter gradients summed in FP32 (a tied embedding's too)
        w = dataclasses.replace(w, head=w.head + 4 * (split.head_unit.numel
                                                      + (split.embed_unit.numel if split.tied else 0)))
    _slide_gpu_buffers(parts, rt, w, plan)
    parts.phases = _slide_phases(split, rt, w)
    _device_update_terms(parts, split, rt, w, schedule, plan)
    _host_state_terms(parts, split, rt, w, plan)
    held, copies = _deferred_host_buffers(parts, split, w, schedule, plan)
    rings = _transfer_buffers(parts, rt, w, schedule, plan)
    kept = plan.gpu_checkpoints
    if kept < w.L:
        parts.host["offloaded checkpoints"] = (w.L - kept) * w.ckpt
    if w.dev == "cuda":
        # ... and a disk-master unit's weights, registered for one async H2D each upload
        parts.pinned = (rings + (w.L - kept) * w.ckpt + held + parts.host.get("disk tier block buffers", 0)
                        + w.b * plan.master_params("disk") + copies)
    parts.host["weight loading transient"] = _weight_loading_transient(split, w, plan, parts.host)


def _slide_gpu_buffers(parts: _Parts, rt: RuntimeConfig, w: _Work, plan: PlacementPlan) -> None:
    """The window's weight and gradient slots, the vocabulary's, the checkpoints kept on the GPU."""
    gpu, b, P_L, L = parts.gpu, w.b, w.P_L, w.L
    K = plan.layer_slots                              # window slots + resident layers' own
    gpu["layer weight slots"] = K * P_L * b
    gb = _grad_slot_bytes(plan, b)
    gpu["layer grad slots"] = plan.grad_slots * P_L * gb
    gpu["vocab weight slots"] = (w.P_E + w.P_H) * b
    gpu["vocab grad slots"] = sum(plan.vocab_grad_slot_numels()) * gb
    if rt.transfer.upload_cast_stream == "compute" and (rt.casts_on_gpu(w.dev == "cuda") or w.dev != "cuda"):
        gpu["fp32 landing buffers (cast on the compute stream)"] = (K * P_L + w.P_E + w.P_H) * 4
    # offload: those kept on the GPU, plus in forward the micro-batches' outputs of the layer
    # being computed and the one whose D2H copy is in flight (in backward, the checkpoint being
    # read and the one prefetched, no more)
    gpu["activation checkpoints"] = min(L * w.ckpt, plan.gpu_checkpoints * w.ckpt + w.ckpt + w.ckpt_micro)
    gpu["layer inputs (masks, rotary, ids)"] = w.layer_inputs


def _slide_phases(split: SplitModel, rt: RuntimeConfig, w: _Work) -> dict[str, int]:
    """slide mode's transient working sets; only the largest counts."""
    ws = working_set_bytes(split, rt, w.B, w.S, w.dtype, masked=w.masks > 0)["peak"]
    return {
        # recompute + backward of one layer; autograd.grad also returns the layer's
        # parameter gradients as fresh tensors before they are copied into a grad slot
        # with several micro-batches, the other micro-batches' output gradients wait beside it,
        # and the layer's gradient sums in FP32 (a compute-dtype sum would round each add)
        "layer working set": int(_working_set_margin(split, rt) * ws)
        + (w.grad_accum - 1) * w.ckpt_micro + summing_bytes(rt.transfer.grad_sum, w.grad_accum, w.P_L),
        # the head phase (head_bytes counts the last layer's output and its gradient)
        "head/logits": w.head,
        # embedding backward: a dense [V, d] gradient, and the incoming gradient
        # every micro-batch's incoming gradient; with several, a micro-batch at a time into
        # an FP32 sum
        "embedding backward": w.P_E * w.b + w.ckpt + (4 * w.P_E if w.grad_accum > 1 else 0),
    }


def _device_update_terms(parts: _Parts, split: SplitModel, rt: RuntimeConfig, w: _Work, schedule: str,
                         plan: PlacementPlan) -> None:
    """The units updated on the GPU: the vocabulary (vocab_update=device) and the device layers."""
    gpu, b = parts.gpu, w.b
    state = FP32_ADAMW.bytes_per_param                # 12 B/param
    n_dev = plan.device_layers
    vocab_device = plan.vocab_on_device
    if vocab_device:
        gpu[f"vocab master + Adam moments (vocab_update=device, {state} B/param)"] = state * (w.P_E + w.P_H)
    P_dev = _device_layer_params(split, plan)
    if n_dev:
        gpu[f"device layers: master + Adam moments ({state} B/param) + own weight slots"] = (state + b) * P_dev
        if schedule == "deferred":
            gpu["device layers' held gradients (deferred schedule)"] = _grad_slot_bytes(plan, b) * P_dev
    own = plan.busiest_shard_units()
    n_own, P_own = len(own), sum(u.numel for u in own)
    if n_own:
        # this GPU's share of the sharded layers: master and moments (their weights come through the
        # window, broadcast by their owners), and their held gradients until the clip is known
        gpu[f"sharded layers this GPU owns ({n_own} of {plan.shard_layers}): master + Adam moments "
            f"({state} B/param)"] = state * P_own
        if schedule == "deferred":
            gpu["sharded layers' held gradients (deferred schedule)"] = _grad_slot_bytes(plan, b) * P_own
    device_units = ([w.P_E, w.P_H] if vocab_device else []) + [u.numel for u in split.layer_units[:n_dev]] \
        + ([max(u.numel for u in own)] if own else [])
    # the update widens a compute-dtype gradient a chunk at a time
    if device_units and _grad_slot_bytes(plan, b) != 4:
        gpu["device update widening buffer"] = 4 * min(rt.transfer.chunk_elems(w.P_L), max(device_units))


def _host_state_terms(parts: _Parts, split: SplitModel, rt: RuntimeConfig, w: _Work, plan: PlacementPlan) -> None:
    """The host-updated units' masters and moments, and the disk tier's share of them."""
    host, b = parts.host, w.b
    # the host-updated units' master and moments: 12 B/param, or less with --moments / --master
    # (plan.host_state), in RAM, the disk tier's files or the shared mapping alike
    ram_state = plan.host_state
    master = ram_state.master_bytes                                       # FP32: 4 B/param
    P_disk = plan.params("disk")
    P_disk_master = plan.master_params("disk")
    label = f"{ram_state.bytes_per_param:g} B/param" + ("" if ram_state is FP32_ADAMW else f", {ram_state.name}")
    host[f"master + Adam moments ({label})"] = int(ram_state.bytes_per_param * (plan.host_updated_params - P_disk))
    if P_disk:
        # the disk tier: moments (and the masters of disk-master units) in its files, through a
        # few pinned block buffers; masters here, or those units' compute-dtype weights
        if P_disk > P_disk_master:
            host[f"disk units' masters ({master} B/param; moments on disk)"] = master * (P_disk - P_disk_master)
        if P_disk_master:
            host[f"disk-master units' weights ({b} B/param; master + moments on disk)"] = b * P_disk_master
        host["disk tier block buffers"] = buffer_bytes(plan, rt.disk.disk_block_mb)
        parts.disk_bytes = tier_bytes(plan, rt.disk.disk_block_mb)


def _deferred_host_buffers(parts: _Parts, split: SplitModel, w: _Work, schedule: str,
                           plan: PlacementPlan) -> tuple[int, int]:
    """The deferred schedule's held gradients and upload copies on the host: (held, copies) bytes."""
    b = w.b
    # one buffer per host-updated unit, and the plan's second buffers (auto left unresolved:
    # one, what the engine does)
    held = b * plan.held_numel() if schedule == "deferred" else 0
    if held:
        two = sum(u.numel for u in plan.units if u.held == 2)
        what = (f"{b} B/param" if not two else f"{2 * b} B/param" if two == plan.host_updated_params else
                f"{b} B/param, {2 * b} for {plan.ranges(lambda u: u.held == 2)}")
        parts.host[f"held gradients (deferred schedule, {what})"] = held
    # clip_sweep=weights: the compute-dtype weights the uploads read, written by the weights pass
    copies = b * plan.upload_copy_numel() if schedule == "deferred" else 0
    if copies:
        parts.host[f"upload copies (clip_sweep weights, {b} B/param)"] = copies
    return held, copies


def _transfer_buffers(parts: _Parts, rt: RuntimeConfig, w: _Work, schedule: str, plan: PlacementPlan) -> int:
    """The upload/download rings on the host, the GPU's cast staging; returns the rings' bytes."""
    b = w.b
    # Mirrors SlideEngine: chunks of chunk_mb MiB of FP32; on CUDA the casts run on the
    # GPU (FP32 master registered in place, FP32 gradient ring, 4 GPU staging chunks).
    chunk_elems = rt.transfer.chunk_elems(w.P_L)
    gpu_cast = rt.casts_on_gpu(w.dev == "cuda")
    deferred = schedule == "deferred"          # gradients straight into the held buffers: no ring
    down_chunks = 0 if deferred else rt.download_chunks(w.P_L)
    downloads_fp32 = rt.downloads_fp32(w.dev == "cuda")
    rings = down_chunks * chunk_elems * (4 if downloads_fp32 else b)
    staging = 0
    if gpu_cast:
        staging += rt.transfer.upload_stages * chunk_elems * 4            # uploads: FP32 from the registered master
    else:
        rings += rt.transfer.upload_ring * chunk_elems * b
    if gpu_cast and downloads_fp32 and not plan.grad_slots_fp32 and not deferred:
        staging += 2 * chunk_elems * 4                           # the D2H stream's cast
    if staging:
        parts.gpu["fp32 cast staging"] = staging
    if not downloads_fp32 and not deferred:
        # widening into FP32 before AdamW where native_adamw's kernel cannot be built
        parts.host["fp32 drain scratch"] = chunk_elems * 4
    parts.host["upload/download rings"] = rings
    return rings


def _weight_loading_transient(split: SplitModel, w: _Work, plan: PlacementPlan, host: dict[str, int]) -> int:
    """Host bytes the model's build passes through before the first step, beyond the offloaded
    checkpoints it never coexists with."""
    # units kept on the device are built a parameter at a time (models.load.fill_on_device:
    # their largest matrix passes through RAM), disk-master units through a host buffer of the
    # whole unit (4 B/param), up to BUILD_WORKERS at once, beside the host units (HostStore)
    def largest(unit) -> int:
        return max((p.numel for p in unit.params), default=0)
    passing = ([largest(split.units[0]), largest(split.units[-1])] if plan.vocab_on_device else []) \
        + [largest(u) for u in split.layer_units[:plan.device_layers]] \
        + [largest(split.units[u.index]) for u in plan.busiest_shard_units()] \
        + [u.numel for u in plan.units if u.master == "disk"]
    building = sorted(passing, reverse=True)[:BUILD_WORKERS]
    # freed before the first step, when the offloaded checkpoints' slots are allocated (in
    # the first forward): the two never coexist, so only what the transient takes beyond
    # them raises the peak
    return max(0, max(w.largest_param, sum(building)) * 4 - host.get("offloaded checkpoints", 0))


# ----------------------------------------------------------------------------- availability


def _parse_bytes(text: str) -> int:
    """'137438953472', '128G', '128GiB', '1.5T' -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    if t and t[-1] in mult:
        return int(float(t[:-1]) * mult[t[-1]])
    return int(float(t))


def query_host_available_bytes() -> int:
    """psutil's available RAM, or SLIDETUNE_HOST_MEMORY_BYTES where the host grows its RAM
    lazily (some VMs report far less than they can give)."""
    env = os.environ.get(ENV_HOST_MEMORY)
    if env:
        try:
            return _parse_bytes(env)
        except ValueError as e:
            raise ValueError(f"{ENV_HOST_MEMORY}={env!r} is not a byte count (e.g. 137438953472 or 128G)") from e
    import psutil
    return int(psutil.virtual_memory().available)


def query_gpu_free_bytes(rt: RuntimeConfig) -> int:
    if not torch.cuda.is_available():
        raise RuntimeError("cannot check GPU memory: CUDA is not available (pass gpu_free_bytes to plan "
                           "for a GPU from this machine)")
    dev = torch.device(rt.device) if rt.device not in (None, "auto") else torch.device("cuda")
    return int(torch.cuda.mem_get_info(dev)[0])


# ----------------------------------------------------------------------------- check


@dataclass
class _Budget:
    device_type: str
    gpu_free: int | None
    host_avail: int
    safety: float
    ranks_per_host: int = 1          # data parallel: the host's ranks share one state (host_bytes_per_host)

    def shortfalls(self, est: MemoryEstimate) -> list[tuple[str, int, int, int, dict[str, int]]]:
        """[(what, needed, usable, available, parts)] for each memory that does not fit."""
        out = []
        if est.device_type == "cuda" and self.gpu_free is not None:
            usable = int(self.safety * self.gpu_free)
            if est.gpu_bytes > usable:
                out.append(("GPU memory", est.gpu_bytes, usable, self.gpu_free, est.gpu_parts))
        usable = int(self.safety * self.host_avail)
        need = est.host_bytes_per_host(self.ranks_per_host)
        if need > usable:
            parts = dict(est.host_parts)
            if est.device_type == "cpu":
                parts.update({f"device: {k}": v for k, v in est.gpu_parts.items()})
            if self.ranks_per_host > 1:
                parts[f"the host's {self.ranks_per_host - 1} other ranks' own buffers"] = need - est.host_total_bytes
            out.append(("host RAM", need, usable, self.host_avail, parts))
        return out

    def fits(self, est: MemoryEstimate) -> bool:
        return not self.shortfalls(est)


@dataclass(frozen=True)
class Workload:
    """A run's shape as the fit estimate and the auto settings read it, beside the model and the
    runtime: one value that `slidetune train`, the benchmarks and the soak build once and pass to
    choose_auto_settings and check_fit (place_on_ranks / check_fit_on_ranks under data parallel)."""
    batch_size: int                    # rows per rank and micro-batch x grad_accum
    seq_len: int
    grad_accum: int = 1
    max_grad_norm: float | None = None
    padded: bool = True                # rows may carry padding ([B,1,S,S] masks); packed or synthetic: False
    gpu_free_bytes: int | None = None  # None: this GPU's free memory now
    ranks_per_host: int = 1

    def fit_kwargs(self) -> dict:
        return dataclasses.asdict(self)


def place_on_ranks(split: SplitModel, rt: RuntimeConfig, work: Workload, ranks) -> RuntimeConfig:
    """The auto settings, chosen on rank 0 from its GPU and shared (`ranks`: slidetune.ranks.Ranks):
    every rank runs the same placement, the host's RAM counted for all of its ranks."""
    return ranks.on_main(lambda: choose_auto_settings(split, rt, **work.fit_kwargs()))


def check_fit_on_ranks(split: SplitModel, rt: RuntimeConfig, work: Workload, ranks) -> None:
    """check_fit on every rank (its own GPU; the host with all of its ranks, the shared state once);
    a refusal anywhere stops every rank."""
    ranks.on_each(lambda: check_fit(split, rt, **work.fit_kwargs()))


def check_fit(split: SplitModel, rt: RuntimeConfig, *, batch_size: int, seq_len: int, grad_accum: int = 1,
              max_grad_norm: float | None = None, gpu_free_bytes: int | None = None,
              host_available_bytes: int | None = None, safety: float = FIT_SAFETY, padded: bool = True,
              ranks_per_host: int = 1, shm_free_bytes: int | None = None,
              disk_free_bytes: int | None = None) -> MemoryEstimate:
    """The estimate if it fits in `safety` x the available memory, else InsufficientMemoryError.

    ranks_per_host: data-parallel ranks on this host; the GPU check is per rank (each has its own
    GPU), the host check counts the shared state once and each rank's own buffers per rank, and
    the shared state must fit the host's /dev/shm (`shm_free_bytes`, default: its free space), and
    the disk tier's files the disk of its directory (`disk_free_bytes`, default: its free space).

    gpu_free_bytes: default torch.cuda.mem_get_info()[0] (device cuda); ignored on device cpu,
    where model state and activations count against host RAM.
    host_available_bytes: default psutil's available RAM, or $SLIDETUNE_HOST_MEMORY_BYTES.
    """
    if not 0 < safety <= 1:
        raise ValueError("safety must be in (0, 1]")
    est = estimate_memory(split, rt, batch_size=batch_size, seq_len=seq_len, grad_accum=grad_accum,
                          max_grad_norm=max_grad_norm, padded=padded, ranks_per_host=ranks_per_host)
    if est.disk_bytes:
        # the disk tier's directory: there, writable, with room for its files (DiskTierError)
        check_directory(rt.disk_dir, est.disk_bytes, disk_free_bytes, state=est.plan.host_state)
    if ranks_per_host > 1 and est.plan is not None:
        # the host's ranks share the state through a tmpfs file (SharedMemoryError, naming the fix;
        # a container's /dev/shm is 64 MB unless it is given more)
        from . import distributed
        distributed.check_shared_memory(shared_state_bytes(est.plan), distributed.SHM_DIR, shm_free_bytes)
    budget = _budget(est, rt, gpu_free_bytes, host_available_bytes, safety, ranks_per_host)
    short = budget.shortfalls(est)
    if not short:
        return est
    options = suggest(split, rt, budget, batch_size=batch_size, seq_len=seq_len, grad_accum=grad_accum,
                      max_grad_norm=max_grad_norm, padded=padded)
    disk_note = _disk_tier_note(split, rt, budget, short, batch_size=batch_size, seq_len=seq_len,
                                grad_accum=grad_accum, max_grad_norm=max_grad_norm, padded=padded)
    raise InsufficientMemoryError(_message(rt, est, short, options, batch_size, seq_len, grad_accum, safety,
                                           disk_note), est, options)


def shared_state_bytes(plan: PlacementPlan) -> int:
    """Data parallel: the bytes of the host's shared state file for a placement (its layout:
    master, moments and step of every host-updated unit, a disk unit's master only)."""
    from .distributed import SharedHostState, shared_layout
    return SharedHostState.layout_bytes(*shared_layout(plan), state=plan.host_state)


def _disk_tier_note(split: SplitModel, rt: RuntimeConfig, budget: _Budget, short, **kw) -> str:
    """Where host RAM is what does not fit and no disk tier was given: what the disk tier would take
    (the auto placement with a disk directory), or "" where it would not help."""
    if rt.mode != "slide" or rt.disk_dir or not any(what == "host RAM" for what, *_ in short) \
            or (budget.device_type == "cuda" and budget.gpu_free is None):
        return ""
    trial = dataclasses.replace(rt, disk_dir="PATH", disk_units=-1)
    placed = choose_auto_settings(split, trial, gpu_free_bytes=budget.gpu_free, host_available_bytes=budget.host_avail,
                                  safety=budget.safety, ranks_per_host=budget.ranks_per_host, **kw)
    est = estimate_memory(split, placed, ranks_per_host=budget.ranks_per_host, **kw)
    options = []
    if not budget.fits(est):
        if any(what == "host RAM" for what, *_ in budget.shortfalls(est)):
            return ""
        # the tier makes host RAM fit and the GPU is what is left: the tier with one of the changes
        # that make the GPU fit
        options = suggest(split, placed, budget, **kw)
        if not options:
            return ""
    n = len(est.plan.indices("disk"))
    masters = est.plan.ranges(lambda u: u.master == "disk") if est.plan.master_params("disk") else ""
    note = (f"With a local disk: --disk-dir PATH (the disk tier: AdamW moments of {n} units, "
            f"{est.plan.ranges(lambda u: u.state == 'disk')}"
            + (f", and the masters of {masters} (--tuning.disk_master)" if masters else "")
            + f", {_gib(est.disk_bytes)} GiB of files there; "
            + (f"GPU {_gib(est.gpu_bytes)} GiB, " if est.device_type == "cuda" else "")
            + f"host {_gib(est.host_bytes_per_host(budget.ranks_per_host))} GiB; each step moves "
              f"{_gib(est.plan.disk_io_bytes())} GiB through the disk)")
    if options:
        note += ", with one of:\n" + "\n".join(f"  --disk-dir PATH {o}" for o in options)
    return note


def choose_auto_settings(split: SplitModel, rt: RuntimeConfig, *, batch_size: int, seq_len: int,
                         grad_accum: int = 1, max_grad_norm: float | None = None,
                         gpu_free_bytes: int | None = None, host_available_bytes: int | None = None,
                         safety: float = FIT_SAFETY, padded: bool = True, ranks_per_host: int = 1) -> RuntimeConfig:
    """_choose_placement's autos, then the host-RAM-only autos beside the chosen placement (they
    cost no GPU memory, so they never displace a placement choice), in this order:
      disk_buffers=-1: the disk tier's block buffers, as many as host RAM has room for, at least 8
        (DISK_BUFFERS_UNRESOLVED) and at most half the disk units' blocks. First: an idle disk
        cost a disk-tier step far more than a gradient slot wait (NOTES.md "Disk tier").
      held_buffers=-1: 2 where the clipped schedule runs and host RAM has room for the second
        buffer, else 1."""
    kw = dict(batch_size=batch_size, seq_len=seq_len, grad_accum=grad_accum, max_grad_norm=max_grad_norm,
              padded=padded)
    recipes = _memory_recipes(split, rt)
    if len(recipes) > 1:
        # the first recipe with which the run fits (GPU and host) without the disk tier, else the
        # first that fits with it (the tier binds a step at the disk's rate: Qwen3-8B b32 with the
        # head's moments on disk 7.15 s, with the lean layer and none there 4.30 s; NOTES.md "Lean layer"),
        # each chosen through the rest of this function; where none fits, the one short of least,
        # so that the refusal and its options start there
        choose = functools.partial(choose_auto_settings, split, gpu_free_bytes=gpu_free_bytes,
                                   host_available_bytes=host_available_bytes, safety=safety,
                                   ranks_per_host=ranks_per_host, **kw)

        def short(c: RuntimeConfig) -> tuple[int, int]:
            miss = _shortfalls(split, c, gpu_free_bytes, host_available_bytes, safety, ranks_per_host, **kw)
            return len(miss), sum(need - usable for _, need, usable, _, _ in miss)
        best, best_short, with_disk = None, None, None
        for recipe in recipes:
            placed = choose(recipe)
            missing = short(placed)
            if missing[0] == 0:
                if not placed.disk_dir or placed.disk.disk_units == 0:
                    return placed
                with_disk = with_disk or placed
            if best is None or missing < best_short:
                best, best_short = placed, missing
        return with_disk or best
    placed = _choose_placement(split, rt, gpu_free_bytes=gpu_free_bytes, host_available_bytes=host_available_bytes,
                               safety=safety, ranks_per_host=ranks_per_host, **kw)
    if placed.mode != "slide":
        return placed
    host = query_host_available_bytes() if host_available_bytes is None else host_available_bytes
    budget = safety * host
    schedule = placed.resolved_schedule(grad_accum, max_grad_norm)

    def host_bytes(c: RuntimeConfig) -> int:
        return estimate_memory(split, c, ranks_per_host=ranks_per_host, **kw).host_bytes_per_host(ranks_per_host)
    if placed.disk.disk_buffers == -1:
        placed = _with_disk_buffers(split, placed, schedule, budget, host_bytes)
    if placed.clip.held_buffers != -1:
        return placed
    one = dataclasses.replace(placed, held_buffers=1, held_second_units=-1)
    if schedule != "deferred":
        return one
    two = dataclasses.replace(one, held_buffers=2)
    if host_bytes(two) <= budget:
        return two
    # Room for some: the lowest host-updated units first (the backward reaches them last, so a
    # second buffer there frees it for the rest of its way down; held_second_units' note), as
    # many as the estimate fits (~1 ms an estimate, once at start-up)
    fits = one
    host_units = sum(u.host_updated for u in PlacementPlan.build(unit_shapes(split), one, schedule).units)
    for count in range(1, host_units):
        some = dataclasses.replace(two, held_second_units=count)
        if host_bytes(some) > budget:
            break
        fits = some
    return fits


def _budget(est: MemoryEstimate, rt: RuntimeConfig, gpu_free_bytes: int | None, host_available_bytes: int | None,
            safety: float, ranks_per_host: int) -> _Budget:
    """The memory an estimate is checked against: the given sizes, else this machine's free GPU
    memory (on CUDA) and available host RAM."""
    if est.device_type == "cuda" and gpu_free_bytes is None:
        gpu_free_bytes = query_gpu_free_bytes(rt)
    host = query_host_available_bytes() if host_available_bytes is None else host_available_bytes
    return _Budget(est.device_type, gpu_free_bytes, int(host), safety, ranks_per_host)


def _shortfalls(split: SplitModel, rt: RuntimeConfig, gpu_free_bytes: int | None, host_available_bytes: int | None,
                safety: float, ranks_per_host: int, **kw) -> list:
    """_Budget.shortfalls of the configuration's estimate against the GPU's and the host's free memory."""
    est = estimate_memory(split, rt, ranks_per_host=ranks_per_host, **kw)
    return _budget(est, rt, gpu_free_bytes, host_available_bytes, safety, ranks_per_host).shortfalls(est)


def _memory_recipes(split: SplitModel, rt: RuntimeConfig) -> list[RuntimeConfig]:
    """Slide mode's memory-saving choices left on auto, resolved into configurations from the
    cheapest in step time to the dearest: every checkpoint on the GPU before offloading some (their
    PCIe traffic shares the link with the uploads; with gpu_checkpoints auto only those that do not
    fit leave), HF's layer before the lean one (1-12% slower a layer, NOTES.md "Lean layer"; it also frees
    GPU room for checkpoints where the host is what binds). One configuration where nothing is on
    auto; on the CPU (no GPU to leave) offload is off."""
    if rt.mode != "slide":
        return [rt]
    on_gpu = _device_type(rt) == "cuda"
    offloads = (["off", "on"] if on_gpu else ["off"]) if rt.offload_activations == "auto" \
        else [rt.offload_activations]
    leans = (["off", "on"] if lean_support_reason(split) is None else ["off"]) if rt.layer.lean_layer == "auto" \
        else [rt.layer.lean_layer]
    return [dataclasses.replace(rt, offload_activations=o, lean_layer=lean) for lean in leans for o in offloads]


def lean_support_reason(split: SplitModel) -> str | None:
    """None where every decoder layer can run lean (models/lean_layer.lean_support), else why not."""
    from ..models.lean_layer import lean_support
    return next((why for why in map(lean_support, split.layer_modules) if why is not None), None)


def _with_disk_buffers(split: SplitModel, rt: RuntimeConfig, schedule: str, budget: float,
                       host_bytes) -> RuntimeConfig:
    """disk_buffers auto (choose_auto_settings): the tier's read-ahead as deep as host RAM's room
    (`budget` over host_bytes(rt) at the least count) allows, at least DISK_BUFFERS_UNRESOLVED (the
    fit counted that many already), at most half the disk units' blocks: half a step read ahead.
    Not more: buffers for every block keep each written block until the next step needs it, so the
    tier stops reading and becomes an in-RAM store of the same size that also writes to disk (a
    Qwen3-8B step with 4 layers on disk then moved 46% of its bytes, at 2.41 s; NOTES.md "Disk tier"). Where
    host RAM could hold that, the moments belong in RAM, which the fit's disk_units auto decides.
    Nothing on disk: `rt` itself, left at auto (moot)."""
    least = dataclasses.replace(rt, disk_buffers=DISK_BUFFERS_UNRESOLVED)
    plan = PlacementPlan.build(unit_shapes(split), least, schedule)
    per_buffer = buffer_bytes(plan, rt.disk.disk_block_mb, 1)
    if not per_buffer:
        return rt
    room = int(budget - host_bytes(least))
    most = max(DISK_BUFFERS_UNRESOLVED, tier_blocks(plan, rt.disk.disk_block_mb) // 2)
    count = max(DISK_BUFFERS_UNRESOLVED, min(most, DISK_BUFFERS_UNRESOLVED + max(0, room) // per_buffer))
    return dataclasses.replace(rt, disk_buffers=count)


@dataclass
class _PlacementSearch:
    """The state _choose_placement's stages share: the workload, the GPU's and host's room, and
    which settings are on auto (the options each may take, the counts filled while room is left)."""

    split: SplitModel
    rt: RuntimeConfig
    batch_size: int
    seq_len: int
    grad_accum: int
    max_grad_norm: float | None
    padded: bool
    safety: float
    ranks_per_host: int
    cache_options: list[int]
    dtype_options: list[str]
    vocab_options: list[str]
    fillable: list[str]          # the counts filled one at a time while the GPU has room
    on_gpu: bool = False
    free: int = 0                # the GPU's free bytes (0 on the CPU)
    host: int = 0                # the host's available bytes

    @classmethod
    def of(cls, split: SplitModel, rt: RuntimeConfig, **work) -> _PlacementSearch:
        """The options `rt`'s auto settings leave open (nothing about the machine yet)."""
        # FP32 slots help the GPU cast path (no cast kernel on the D2H stream); with compute-dtype
        # downloads or cast_on=cpu the host widens the gradients anyway
        p, t = rt.placement, rt.transfer
        fp32_useful = rt.casts_on_gpu(_device_type(rt) == "cuda") and t.grad_download == "fp32"
        dtype_options = (["fp32", "compute"] if fp32_useful else ["compute"]) if t.grad_slot_dtype == "auto" \
            else [t.grad_slot_dtype]
        vocab_options = ["device", "host"] if p.vocab_update == "auto" else [p.vocab_update]
        # each fillable count grows the estimate; resident layers are auto only beside an auto
        # window: an explicit cache_units=3 asks for the small-window placement
        fillable = [name for name, auto in (("resident_layers", p.resident_layers == -1 and p.cache_units == -1),
                                            ("device_layers", p.device_layers == -1),
                                            ("gpu_checkpoints", p.gpu_checkpoints == -1 and rt.offloads_activations))
                    if auto]
        return cls(split=split, rt=rt, cache_options=cache_unit_options(p.cache_units),
                   dtype_options=dtype_options, vocab_options=vocab_options, fillable=fillable, **work)

    def nothing_on_auto(self) -> bool:
        rt = self.rt
        return len(self.cache_options) == 1 and rt.transfer.grad_slot_dtype != "auto" \
            and rt.placement.vocab_update != "auto" \
            and rt.placement.device_layers != -1 and "gpu_checkpoints" not in self.fillable \
            and (rt.disk.disk_units != -1 or not rt.disk_dir) and (rt.disk.disk_master != "auto" or not rt.disk_dir) \
            and (rt.placement.shard_layers != -1 or self.ranks_per_host < 2)

    def candidate(self, cache_units: int, vocab: str, grad_dtype: str) -> RuntimeConfig:
        rt, p = self.rt, self.rt.placement
        return dataclasses.replace(rt, cache_units=cache_units, grad_slot_dtype=grad_dtype, vocab_update=vocab,
                                   device_layers=max(0, p.device_layers), gpu_checkpoints=max(0, p.gpu_checkpoints),
                                   resident_layers=max(0, p.resident_layers), disk_units=max(0, rt.disk.disk_units),
                                   shard_layers=max(0, p.shard_layers),
                                   disk_master="off" if rt.disk.disk_master == "auto" else rt.disk.disk_master)

    def lean(self) -> RuntimeConfig:
        return self.candidate(self.cache_options[-1], self.vocab_options[-1], self.dtype_options[-1])

    def estimate(self, c: RuntimeConfig) -> MemoryEstimate:
        return estimate_memory(self.split, c, batch_size=self.batch_size, seq_len=self.seq_len,
                               grad_accum=self.grad_accum, max_grad_norm=self.max_grad_norm, padded=self.padded,
                               ranks_per_host=self.ranks_per_host)

    def fits(self, c: RuntimeConfig) -> bool:
        return not self.on_gpu or self.estimate(c).gpu_bytes <= self.safety * self.free

    def host_bytes(self, c: RuntimeConfig) -> int:
        return self.estimate(c).host_bytes_per_host(self.ranks_per_host)

    def host_fits(self, c: RuntimeConfig) -> bool:
        return self.host_bytes(c) <= self.safety * self.host

    def fill(self, c: RuntimeConfig, order: list[str]) -> RuntimeConfig:
        """`c` with each fillable count of `order`, in turn, as high as the GPU still holds."""
        L = self.split.num_layers
        for name in (n for n in order if n in self.fillable):
            if name == "resident_layers" and c.placement.cache_units == 0:
                continue                              # every host layer is resident already
            top = L - c.placement.device_layers - c.placement.shard_layers if name == "resident_layers" else L
            k = c.setting(name)
            while k < top and self.fits(dataclasses.replace(c, **{name: k + 1})):
                k += 1
            c = dataclasses.replace(c, **{name: k})
        return c

    def fewest_device_layers(self, c: RuntimeConfig) -> RuntimeConfig | None:
        """`c` with the fewest device layers (auto) that make the host fit, or None."""
        ks = range(c.placement.device_layers, self.split.num_layers + 1) if "device_layers" in self.fillable \
            else [c.placement.device_layers]
        for k in ks:
            t = dataclasses.replace(c, device_layers=k)
            if not self.fits(t):
                return None
            if self.host_fits(t):
                return t
        return None

    def fastest(self, lean: RuntimeConfig) -> RuntimeConfig:
        """For speed: the first option set that fits, then the resident layers (each saves a layer's
        upload per step), then the device layers (each takes its AdamW off the host), then the
        checkpoints."""
        first = next((c for cache_units in self.cache_options for vocab in self.vocab_options
                      for grad_dtype in self.dtype_options if self.fits(c := self.candidate(cache_units, vocab,
                                                                                           grad_dtype))), lean)
        return self.fill(first, ["resident_layers", "device_layers", "gpu_checkpoints"])

    def host_bound(self) -> list[RuntimeConfig]:
        """Host RAM binds: the GPU's room first to what takes the most off the host per GPU byte
        (checkpoints, then device layers), but only as many device layers as the host needs;
        what is left goes to speed again (resident layers, then more device layers). One
        configuration per window and vocabulary option that fits the GPU, the smallest window first."""
        leanest = []
        for cache_units in sorted(self.cache_options, reverse=True):
            for vocab in self.vocab_options:
                if not self.fits(c := self.candidate(cache_units, vocab, self.dtype_options[-1])):
                    continue
                c = self.fill(c, ["gpu_checkpoints"])
                enough = self.fewest_device_layers(c)
                leanest.append(self.fill(enough, ["resident_layers", "device_layers"]) if enough
                               else self.fill(c, ["device_layers"]))
        return leanest

    def sharded(self, candidates: list[RuntimeConfig]) -> RuntimeConfig | None:
        """Data parallel, shard_layers auto, where the host's RAM does not hold what the GPUs leave it
        even with their room given to it: the fewest sharded layers that make it (each takes 12 B/param
        off the host, and 2 more of held gradient when clipped, for 1/N of that on each of the N
        GPUs, where a device layer costs every GPU 16), from each candidate in turn (the leanest
        first) with its device layers given back to them, then the GPU's room left to resident
        layers. Where none makes the host fit: the one with the most the GPUs hold that needs the
        least host (the disk tier takes the rest). None: not data parallel on GPUs, or set."""
        if self.ranks_per_host < 2 or self.rt.placement.shard_layers != -1 or not self.on_gpu:
            return None
        L, best = self.split.num_layers, None
        for c in candidates:
            if "device_layers" in self.fillable:
                c = dataclasses.replace(c, device_layers=0)
            if "resident_layers" in self.fillable:
                c = dataclasses.replace(c, resident_layers=0)
            lo, hi = 0, L - c.placement.device_layers
            while lo < hi:          # the most the GPUs hold
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self.fits(dataclasses.replace(c, shard_layers=mid)) else (lo, mid - 1)
            most = dataclasses.replace(c, shard_layers=lo)
            if not lo or not self.fits(most):
                continue
            if not self.host_fits(most):
                best = most if best is None or self.host_bytes(most) < self.host_bytes(best) else best
                continue
            lo, hi = 1, lo
            while lo < hi:          # the fewest that make the host fit (more only move more state)
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if self.host_fits(dataclasses.replace(c, shard_layers=mid)) else (mid + 1, hi)
            return self.fill(dataclasses.replace(c, shard_layers=lo), ["resident_layers"])
        return best

    def onto_disk(self, least: RuntimeConfig) -> RuntimeConfig:
        """RAM and GPU cannot hold the state: with disk_units auto, the disk tier takes the moments
        of as few units as make the host fit (the head, then layers from the top down; each 8
        B/param off the host); then disk_master auto (with_disk_masters)."""
        if self.rt.disk.disk_units == -1 and self.rt.disk_dir:
            host_units = PlacementPlan.build(unit_shapes(self.split), least).disk_capacity()
            for k in range(1, host_units + 1):
                c = dataclasses.replace(least, disk_units=k)
                if self.host_fits(c) and self.fits(c):
                    return c
            least = dataclasses.replace(least, disk_units=host_units)
        return self.with_disk_masters(least)

    def with_disk_masters(self, c: RuntimeConfig) -> RuntimeConfig:
        """disk_master auto, where the moments on disk do not make the host fit: the masters of as
        few of `c`'s disk units as do (in disk order; each 4 - b B/param more off the host, for 8
        more through the disk). Every disk unit on disk first, moments only, then masters: the
        same RAM for the least disk traffic (moving a unit's moments saves 8 B/param for 16 of
        I/O a step, its master then 2 more for 8 more). None fitting: all of them, where that
        helps at all (a compute dtype of 4 bytes saves nothing). Not under data parallel (the
        engine refuses it there)."""
        if self.rt.disk.disk_master != "auto" or self.ranks_per_host > 1 or self.host_fits(c):
            return c
        n = len(PlacementPlan.build(unit_shapes(self.split), c).indices("disk"))
        for m in range(1, n + 1):
            t = dataclasses.replace(c, disk_master="on" if m == n else str(m))
            if self.host_fits(t) and self.fits(t):
                return t
        every = dataclasses.replace(c, disk_master="on")
        return every if n and self.host_bytes(every) < self.host_bytes(c) else c


def _choose_placement(split: SplitModel, rt: RuntimeConfig, *, batch_size: int, seq_len: int,
                      grad_accum: int = 1, max_grad_norm: float | None = None,
                      gpu_free_bytes: int | None = None, host_available_bytes: int | None = None,
                      safety: float = FIT_SAFETY, padded: bool = True, ranks_per_host: int = 1) -> RuntimeConfig:
    """Resolve slide mode's memory-dependent autos: cache_units=-1 (with resident_layers=-1),
    vocab_update=auto, grad_slot_dtype=auto, device_layers=-1, gpu_checkpoints=-1, and with a
    disk directory disk_units=-1 and disk_master=auto.

    For speed, in order of what they bought on the H100: one slot per layer (the forward stops
    waiting on PCIe; Qwen3-8B b16 2.65 -> 2.36 s, benchmarks/NOTES.md "PCIe uploads"), then the vocabulary
    units updated on the GPU (the host's AdamW, the bound, loses 13% of its work on
    Llama-3.1-8B; NOTES.md "GPU-updated units"), then FP32 gradient slots (the copy stream
    runs no cast kernels; Llama-3.1-8B b16 2.38 -> 2.16 s, NOTES.md "Gradient downloads"), then with
    device_layers=-1 as many of the lowest layers kept and updated on the GPU as still fit
    (NOTES.md "Host AdamW"), then with offload and gpu_checkpoints=-1 as many checkpoints as still fit.
    Each is taken only where the whole configuration then fits in `safety` x the GPU's free
    memory, so an auto choice never causes an OOM the lean choice would not; otherwise the
    3-slot window with as many resident layers as fit, and compute-dtype slots.

    Where that configuration does not fit in `safety` x the host's available RAM (long
    sequences with offloaded checkpoints, models near 12 B/param of the host's RAM), the GPU's
    room goes instead to what takes the most off the host per GPU byte: the 3-slot window
    (resident layers save no host RAM), the vocabulary units on the GPU, then checkpoints
    (a GPU byte for each host byte), then the fewest device layers (12 host bytes for 14 GPU
    bytes) that make the host fit; the room left goes to resident layers (Qwen3-14B on an H200:
    the window alone left its b8 step bound by uploads, NOTES.md "PCIe uploads"), then more device layers.
    If even that does not fit, the disk tier (with a disk directory): the moments of as few
    units as make the host fit, then, where every unit that may go there is not enough, the
    masters of as few of them (disk_master auto; off wherever the moments suffice). Failing
    that, the configuration that needs the least host RAM is returned and check_fit reports
    it. On the CPU (nothing to hide) the lean choices (disk_master auto: off).
    Settings given explicitly are kept; with nothing on auto, `rt` itself is returned.

    ranks_per_host: data-parallel ranks on this host, each with a GPU like this one. The GPU
    checks are per rank; the host check counts the shared state once and each rank's own
    buffers per rank (MemoryEstimate.host_bytes_per_host), so N ranks may need the GPU to take
    more off the host than one rank would.
    """
    if rt.mode != "slide":
        return rt
    search = _PlacementSearch.of(split, rt, batch_size=batch_size, seq_len=seq_len, grad_accum=grad_accum,
                                 max_grad_norm=max_grad_norm, padded=padded, safety=safety,
                                 ranks_per_host=ranks_per_host)
    if search.nothing_on_auto():
        return rt
    lean = search.lean()
    on_gpu = _device_type(rt) == "cuda"
    if not on_gpu and not (rt.disk.disk_units == -1 and rt.disk_dir):
        return lean
    search.on_gpu = on_gpu
    search.free = (query_gpu_free_bytes(rt) if gpu_free_bytes is None else gpu_free_bytes) if on_gpu else 0
    search.host = query_host_available_bytes() if host_available_bytes is None else host_available_bytes
    if not on_gpu:
        # the CPU (nothing to hide, nothing on a GPU): the lean choices, and where host RAM does not
        # hold them, the disk tier
        if search.host_fits(lean):
            return lean
        fastest, leanest = lean, []
    else:
        fastest = search.fastest(lean)
        if search.host_fits(fastest):
            return fastest
        leanest = search.host_bound()
        fitting = next((c for c in leanest if search.host_fits(c)), None)
        if fitting is not None:
            return fitting
        sharded = search.sharded(leanest)
        if sharded is not None and search.host_fits(sharded):
            return sharded
        leanest += [sharded] if sharded is not None else []
    return search.onto_disk(min([fastest, *leanest], key=search.host_bytes))


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def _message(rt, est, short, options, B, S, accum, safety, disk_note: str = "") -> str:
    lines = [f"slidetune: mode {rt.mode}, batch {B} x {S} tokens"
             + (f" x {accum} micro-batches" if accum > 1 else "") + f", {rt.dtype} on {est.device_type}: "
             + " and ".join(w for w, *_ in short) + " too small."]
    for what, need, usable, avail, parts in short:
        lines.append(f"  {what}: needs {_gib(need)} GiB, usable {_gib(usable)} GiB "
                     f"({safety:.0%} of {_gib(avail)} GiB available).")
        top = sorted(parts.items(), key=lambda kv: -kv[1])[:5]
        lines.append("    largest items: " + ", ".join(f"{k} {_gib(v)} GiB" for k, v in top))
        if what == "host RAM":
            lines.append(f"    (if this host grows its RAM on demand, set {ENV_HOST_MEMORY} to what it can give)")
    if options:
        lines.append("Options that fit (per the same estimate):")
        lines += [f"  {o}" for o in options]
    if disk_note:
        lines.append(disk_note)
    if not options and not disk_note:
        lines.append("No single change among batch size, activation offload, cache slots, head chunking "
                     "and mode fits: use a smaller model or sequence length, or a machine with more memory.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- suggestions


def _fmt_flag(name: str, value) -> str:
    flag = cli_flag(name)                             # --tuning.NAME for a tuning knob
    if value is True:
        return flag                                   # boolean flags take no value when true
    if value is False:
        value = "false"
    return f"{flag} {value}"


@dataclass
class _Suggestions:
    """suggest's state: the configuration and budget, the lines found so far and the largest
    micro-batch the plain batch reduction reached (a change no better than it adds nothing)."""

    split: SplitModel
    rt: RuntimeConfig
    budget: _Budget
    batch_size: int
    seq_len: int
    grad_accum: int
    max_grad_norm: float | None
    limit: int
    padded: bool
    out: list[str] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    plain_best: int = 0

    @property
    def total(self) -> int:
        """Sequences per step."""
        return self.batch_size * self.grad_accum

    def attempt(self, changes: dict, B: int, accum: int, clip) -> MemoryEstimate | None:
        """The estimate with `changes` at micro-batch B, where it fits the budget; else None."""
        ch = dict(changes)
        try:
            est = estimate_memory(self.split, dataclasses.replace(self.rt, **ch) if ch else self.rt, batch_size=B,
                                  seq_len=self.seq_len, grad_accum=accum, max_grad_norm=clip, padded=self.padded,
                                  ranks_per_host=self.budget.ranks_per_host)
        except ValueError:
            return None
        return est if self.budget.fits(est) else None

    def accum_for(self, B: int, keep_total: bool) -> int:
        return -(-self.total // B) if keep_total else self.grad_accum

    def largest_batch(self, changes: dict, keep_total: bool) -> int | None:
        """Bisection: the estimate is monotone in the batch."""
        lo, hi, best = 1, self.batch_size - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            if self.attempt(changes, mid, self.accum_for(mid, keep_total), self.max_grad_norm) is not None:
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return best

    def add(self, flags: list[str], est: MemoryEstimate, note: str = "") -> None:
        key = " ".join(flags)
        if key in self.seen or len(self.out) >= self.limit:
            return
        self.seen.add(key)
        where = (f"GPU {_gib(est.gpu_bytes)} GiB, " if est.device_type == "cuda" else "") + \
            f"host {_gib(est.host_total_bytes)} GiB"
        self.out.append(f"{key}  -> {where}" + (f" ({note})" if note else ""))

    def flags_of(self, changes: dict, B: int | None = None, accum: int | None = None) -> list[str]:
        flags = [_fmt_flag(k, v) for k, v in changes.items()]
        if B is not None:
            flags.append(_fmt_flag("batch_size", B))
        if accum is not None and accum != self.grad_accum:
            flags.append(_fmt_flag("grad_accum", accum))
        return flags

    def consider(self, changes: dict) -> bool:
        """Add the change (with a smaller micro-batch if needed); True if it fits somehow."""
        est = self.attempt(changes, self.batch_size, self.grad_accum, self.max_grad_norm)
        if est is not None:
            self.add(self.flags_of(changes), est)
            return True
        if self.batch_size == 1:
            return False
        for keep_total in (True, False):
            best = self.largest_batch(changes, keep_total)
            if best is None:
                continue
            if not changes:
                self.plain_best = max(self.plain_best, best)
            elif best <= self.plain_best:
                return True       # no better than reducing the batch alone
            pick = best
            if keep_total:        # prefer a divisor of the sequences per step: the same effective batch
                divisor = next(k for k in range(best, 0, -1) if self.total % k == 0)
                pick = divisor if 2 * divisor > best else best
            accum = self.accum_for(pick, keep_total)
            est = self.attempt(changes, pick, accum, self.max_grad_norm)
            note = f"{pick * accum} sequences per step" + ("" if keep_total else f" instead of {self.total}")
            if pick != best:
                note += f"; largest micro-batch that fits: {best}"
            self.add(self.flags_of(changes, pick, accum), est, note)
            return True
        return False

    def auto_placement(self) -> None:
        """Where placements were given explicitly: the one the auto settings would choose on this
        GPU and host (which turns to the host's RAM where that is what does not fit)."""
        rt, budget = self.rt, self.budget
        if not (rt.mode == "slide" and budget.device_type == "cuda" and budget.gpu_free is not None):
            return
        fields = ["cache_units", "vocab_update", "grad_slot_dtype", "device_layers"] + \
            (["gpu_checkpoints"] if rt.offloads_activations else []) + \
            (["disk_units", "disk_master"] if rt.disk_dir else [])
        # the disk tier re-resolved with the rest: disk units counted for one placement (the head on
        # the host) are one too many for another (the head on the GPU)
        disk = dict(disk_units=-1, disk_master="auto") if rt.disk_dir else {}
        placed = choose_auto_settings(
            self.split, dataclasses.replace(rt, cache_units=-1, vocab_update="auto", grad_slot_dtype="auto",
                                            device_layers=-1, gpu_checkpoints=-1, **disk),
            batch_size=self.batch_size, seq_len=self.seq_len, grad_accum=self.grad_accum,
            max_grad_norm=self.max_grad_norm, gpu_free_bytes=budget.gpu_free, host_available_bytes=budget.host_avail,
            safety=budget.safety, padded=self.padded)
        changes = {k: placed.setting(k) for k in fields if placed.setting(k) != rt.setting(k)}
        if changes:
            self.consider(changes)

    def slide_buffers(self) -> None:
        """slide mode's single changes, cheapest first: offload, a smaller window, one grad slot."""
        rt = self.rt
        if rt.mode != "slide":
            return
        if not rt.offloads_activations:
            self.consider({"offload_activations": "on"})
        if rt.placement.cache_units == 0:
            self.consider({"cache_units": 3})
        if rt.placement.cache_units != 2:
            self.consider({"cache_units": 2})
        if rt.resolved_grad_slots(self.split.num_layers) > 1:
            self.consider({"grad_slots": 1})

    def head_chunks(self) -> None:
        """The chunked head, else smaller logits chunks: the largest chunk that fits at the current batch."""
        rt = self.rt
        head_base = {"head_impl": "chunked"} if rt.resolved_head_impl == "full" else {}
        if head_base and self.consider(head_base):
            return
        chunk = min(rt.head.head_chunk_tokens, self.batch_size * self.seq_len) // 2
        while chunk >= 256:
            if self.attempt(dict(head_base, head_chunk_tokens=chunk), self.batch_size, self.grad_accum,
                            self.max_grad_norm):
                self.consider(dict(head_base, head_chunk_tokens=chunk))
                break
            chunk //= 2

    def modes(self) -> None:
        """gpu and ckpt modes: recompute every layer, or slide."""
        rt, L = self.rt, self.split.num_layers
        if rt.mode == "gpu":
            self.consider({"mode": "ckpt", "recompute": "all"})
        if rt.mode == "ckpt" and recompute_set(rt.recompute, L) != set(range(L)):
            self.consider({"recompute": "all"})
        if rt.mode in ("gpu", "ckpt"):
            if not self.consider({"mode": "slide"}):
                self.consider({"mode": "slide", "offload_activations": "on"})

    def all_at_once(self) -> None:
        """Everything that saves GPU memory at once, when no single change is enough."""
        if self.out:
            return
        rt = self.rt
        lean = {"mode": "slide", "offload_activations": "on", "cache_units": 2, "grad_slots": 1,
                "head_impl": "chunked" if rt.resolved_head_impl == "full" else rt.resolved_head_impl,
                "head_chunk_tokens": min(rt.head.head_chunk_tokens, 1024)}
        lean = {k: v for k, v in lean.items() if rt.setting(k) != v}
        if lean:
            self.consider(lean)

    def compact_moments(self) -> None:
        """Host: the first compact state smaller than the run's that fits, least rounding first
        (opt-in, named as a change of the arithmetic): BF16 moments (12 -> 8 B/param of a host
        unit's state), 8-bit moments (~6), then a BF16 master beside them (~4); a run already on a
        compact state is offered what it lacks (--moments 8bit: --master bf16). In RAM, the shared
        mapping or the disk tier alike."""
        rt = self.rt
        if rt.mode != "slide" or rt.host.host_adamw == "torch":
            return
        now = {"master": rt.master, "moments": rt.moments}
        for step in ({"moments": "bf16"}, {"moments": "8bit"}, {"master": "bf16", "moments": "8bit"}):
            merged = now | step
            if optimizer_state(**merged).bytes_per_param >= rt.host_state.bytes_per_param:
                continue
            change = {k: v for k, v in merged.items() if v != now[k]}
            est = self.attempt(change, self.batch_size, self.grad_accum, self.max_grad_norm)
            if est is not None:
                what = " and ".join(f"{'AdamW' + chr(39) + 's moments' if k == 'moments' else 'the master'} in {v}"
                                    for k, v in sorted(change.items(), key=lambda kv: kv[0] != "moments"))
                self.add([_fmt_flag(k, v) for k, v in change.items()], est,
                         f"opt-in: {what}, not the FP32 reference's arithmetic")
                return

    def no_clipping(self) -> None:
        """Host: the deferred schedule (clipping) holds the step's gradients, eager does not."""
        rt = self.rt
        if rt.mode == "slide" and rt.clip.schedule != "deferred" and (self.max_grad_norm or 0) > 0:
            est = self.attempt({}, self.batch_size, self.grad_accum, None)
            if est is not None:
                self.add([_fmt_flag("max_grad_norm", 0)], est,
                         "eager schedule, no held gradients; changes the recipe: no clipping")


def suggest(split: SplitModel, rt: RuntimeConfig, budget: _Budget, *, batch_size: int, seq_len: int,
            grad_accum: int, max_grad_norm: float | None, limit: int = 8, padded: bool = True) -> list[str]:
    """Changes that fit per the estimate, cheapest first; each a line of CLI flags + the result.

    Each candidate change is tried at the current micro-batch; where it does not fit, the
    largest micro-batch that does is searched (bisection: the estimate is monotone in the
    batch), keeping the sequences per step through more accumulation. A candidate that
    only fits at the same reduced batch as the plain batch reduction adds nothing and is
    left out.
    """
    s = _Suggestions(split=split, rt=rt, budget=budget, batch_size=batch_size, seq_len=seq_len,
                     grad_accum=grad_accum, max_grad_norm=max_grad_norm, limit=limit, padded=padded)
    s.consider({})            # the same configuration with a smaller micro-batch (more accumulation)
    s.auto_placement()
    s.slide_buffers()
    s.head_chunks()
    s.modes()
    s.all_at_once()
    s.compact_moments()
    s.no_clipping()
    return s.out
