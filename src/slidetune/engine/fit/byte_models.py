"""The byte models: what one decoder layer, the lean layer and the head hold at their peak, and
what a layer's micro-batch gradient sum takes, from the skeleton's shapes (nothing is allocated).

Notation: P_L the largest decoder layer, b bytes per element of the compute dtype (2 for bf16),
N = B*S tokens per micro-batch, d hidden width, V vocabulary, I the MLP width. The estimate
(estimate.py) adds these up with the engines' buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...models.units import SplitModel
from ..config import RuntimeConfig

GiB = 2**30
MiB = 2**20
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


# ----------------------------------------------------------------------------- shapes


@dataclass
class ModelShape:
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


def _widest(c, name: str):
    """A layer attribute's largest value over the layers: a config whose layers differ (transformers'
    per_layer_config, Gemma 4: the full-attention layers' head_dim 512 against the sliding ones' 256)
    answers the global attribute with one kind's value, and a layer's working set is the widest's."""
    per = getattr(c, "per_layer_config", None)
    values = [getattr(x, name, None) for x in per] if per is not None and not isinstance(per, dict) else []
    values = [v for v in values if v is not None]
    return max(values) if values else getattr(c, name, None)


def model_shape(split: SplitModel) -> ModelShape:
    c = split.config
    d = int(c.hidden_size)
    heads = int(_widest(c, "num_attention_heads"))
    kv = int(_widest(c, "num_key_value_heads") or heads)
    hd = int(_widest(c, "head_dim") or d // heads)
    inter = _widest(c, "intermediate_size")
    if inter is None:  # derive from the layer's size: 3 d*I MLP matrices beside attention
        attn = d * heads * hd * 2 + d * kv * hd * 2
        inter = max(1, (max(u.numel for u in split.layer_units) - attn) // (3 * d))
    names = {p.local_name for p in split.layer_units[0].params} if split.layer_units else set()
    qk_norm = any("q_norm" in n for n in names)
    types = getattr(c, "layer_types", None)
    window = getattr(c, "sliding_window", None)
    # a window applies where layer_types names sliding layers, or (no layer_types: Mistral) to every layer
    sliding = ("sliding_attention" in types) if types else window is not None
    return ModelShape(d=d, inter=int(inter), heads=heads, kv_heads=kv, head_dim=hd, vocab=int(c.vocab_size),
                  layers=split.num_layers, qk_norm=qk_norm, mask_types=max(1, len(set(types or []))),
                  sliding_window=int(window) if sliding and window else None)


def materialized_masks(split: SplitModel, seq_len: int, padded: bool) -> int:
    """How many [B,1,S,S] attention masks HF builds for a batch (SDPA): one per mask kind when the
    batch may carry padding; without padding none for causal attention (SDPA's is_causal), one
    for sliding-window layers whose window is shorter than the sequence (checked against HF in
    tests/test_fit.py)."""
    sh = model_shape(split)
    if padded:
        return sh.mask_types
    return 1 if sh.sliding_window is not None and seq_len > sh.sliding_window else 0


def device_type_of(rt: RuntimeConfig) -> str:
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
    sh = model_shape(split)
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
    sh = model_shape(split)
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
    spans = (2 * b * batch_size * seq_len * model_shape(split).d
             + 4 * max((u.numel for u in split.layer_units), default=0))
    return {"saved": tile["saved"], "peak": tile["peak"] + spans,
            "peak_no_param_grads": tile["peak_no_param_grads"] + spans}


def compiled_layer_activation_bytes(split: SplitModel, batch_size: int, seq_len: int, dtype: torch.dtype,
                                    masked: bool = True) -> dict[str, int]:
    """layer_activation_bytes for HF's layer compiled (compile_layers on): inductor's partitioner
    saves the matmuls' and SDPA's inputs and outputs and recomputes the pointwise work (norms,
    rotary, SiLU, act*up) in the backward's fused kernels, so about 0.6 of the eager layer's bytes.
    Per token, b = compute-dtype bytes (d, I, hq, hk as in layer_activation_bytes):
      saved: SDPA's q, k, v and output, the q/k projections' outputs b*(2 hq + 2 kv) (kv: hq with a
          padding mask, HF's repeat_kv), Qwen3's pre-norm q/k b*(hq + hk), the post-attention
          residual b*d, gate and up b*2I, the norms' 1/rms and SDPA's logsumexp in FP32
          4*(2 + heads); with a padding mask its copy b*S;
      the MLP's backward at its start (the peak): act*up recomputed for down_proj's weight
          gradient, its gradient, and gate's and up's gradients b*3I, the output and input
          gradients b*2d, down_proj's weight gradient b*d*I;
      the attention's backward: saved less gate and up, SDPA's and rotary's gradients
          b*(5 hq + 2 kv), flash's FP32 dq 4*hq, the normed input's gradient b*d, the MLP's
          weight gradients; the end: every parameter gradient b*P_L and 3 b*d.
    Against the H200 (benchmarks/results/lean_layer/layer_memory.json, `hf-compiled`, torch 2.11):
    Qwen3-8B 16 x 1024 2.82 GiB (measured 2.69), 64 x 1024 10.98 (10.49), Llama-3.1-8B 1 x 65536
    11.62 (10.87): 5-7% above, before ACTIVATION_MARGIN (tests/test_fit.py)."""
    sh = model_shape(split)
    b = torch.empty((), dtype=dtype).element_size()
    d, inter, hq, hk, heads, S = sh.d, sh.inter, sh.hq, sh.hk, sh.heads, seq_len
    N = batch_size * seq_len
    kv = hq if masked else hk
    saved = b * (2 * hq + 2 * kv + d + 2 * inter) + 4 * (2 + heads)
    if sh.qk_norm:
        saved += b * (hq + hk)
    if masked:
        saved += b * S
    p_layer = max((u.numel for u in split.layer_units), default=0)
    p_mlp = min(3 * d * inter, p_layer)
    phases = [(N * (saved + b * (3 * inter + 2 * d)), b * d * inter),
              (N * (saved - 2 * b * inter + b * (5 * hq + 2 * kv + d) + 4 * hq), b * p_mlp),
              (N * 3 * b * d, b * p_layer)]
    workspace = 128 * 2**10                                     # as in layer_activation_bytes
    return {"saved": N * saved,
            "peak": max(a + g for a, g in phases) + workspace,
            "peak_no_param_grads": max(a for a, _ in phases) + workspace}


def working_set_margin(split: SplitModel, rt: RuntimeConfig) -> float:
    """The margin on one layer's working set: ACTIVATION_MARGIN on HF's layer (a count of saved
    tensors, eager or compiled); none on the lean layer's, whose count is fitted to the H200's
    measured peaks and sits 11-16% above them (lean_layer_bytes)."""
    from ..slide.layer_runner import resolve_lean_layer
    return 1.0 if resolve_lean_layer(split, rt) == "on" else ACTIVATION_MARGIN


def fit_counts_compiled(rt: RuntimeConfig) -> bool:
    """Whether the fit counts HF's layer compiled (compiled_layer_activation_bytes, ~0.6 of the eager
    layer's bytes): compile_layers on, or auto in slide mode on CUDA, which a long run resolves on and
    train keeps on where the placement needs it (compile_policy.choose_compile_layers'
    `placement_needs_it`)."""
    if rt.compile_layers != "auto" or rt.mode != "slide":
        return rt.compile_layers == "on"
    return device_type_of(rt) == "cuda"


def working_set_bytes(split: SplitModel, rt: RuntimeConfig, batch_size: int, seq_len: int, dtype: torch.dtype,
                      masked: bool) -> dict[str, int]:
    """One layer's recompute + backward as the slide engine runs it: the lean layer's where the
    runtime resolves it on (engine/slide/layer_runner.resolve_lean_layer), else HF's, compiled where
    the run compiles its layers (fit_counts_compiled: auto on CUDA counts on the
    compile, and train then keeps it on where eager's working set would not fit)."""
    from ..slide.layer_runner import resolve_lean_layer
    if resolve_lean_layer(split, rt) == "on":
        return lean_row_tiled_bytes(split, batch_size, seq_len, dtype, rt.layer.mlp_tile_tokens,
                                    rt.layer.layer_row_tokens, masked=masked)
    if fit_counts_compiled(rt):
        return compiled_layer_activation_bytes(split, batch_size, seq_len, dtype, masked=masked)
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
    sh = model_shape(split)
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
    from ...ops.cross_entropy import _fused_backend
    return _fused_backend()

def summing_bytes(grad_sum: str, micro_batches: int, params: int) -> int:
    """Device bytes one layer's micro-batch gradient sum holds (engine/slide/grad_sum.py's rule);
    auto, resolved on the GPU machine, counts the larger of its two ways."""
    from ..slide.grad_sum import accumulation_bytes
    ways = ("torch", "fused") if grad_sum == "auto" else (grad_sum,)
    return max(accumulation_bytes(w, micro_batches, params) for w in ways)


def side_input_bytes(split: SplitModel, batch_size: int, seq_len: int, dtype: torch.dtype) -> int:
    """Device bytes one micro-batch's side inputs hold at their peak (models/layer_sides.py: Gemma 4
    E2B / E4B; 0 for every other family), kept from the embedding's forward to its backward, beside
    the layers' working set: the per-layer inputs N*L*D_pl*b and, from the last layer's backward on,
    their gradient as much again; with KV sharing each producer's keys and values
    (2*N*kv_heads*head_dim*b, its own attention width) and, from the first shared layer's backward
    to the producer's, their summed gradient as much again. E2B at 64K tokens in BF16: 2 x 1.1 GiB
    of per-layer inputs, 2 x 0.2 GiB of K/V; estimate.py counts it once a micro-batch."""
    b = torch.empty((), dtype=dtype).element_size()
    n = batch_size * seq_len
    per_layer = n * split.num_layers * int(getattr(split.config, "hidden_size_per_layer_input", 0) or 0) * b \
        if split.per_layer_modules else 0
    shared = 0
    if split.kv_sharing:
        attns = [getattr(m, "self_attn", None) for m in split.layer_modules]
        read = {a.layer_type for a in attns if getattr(a, "is_kv_shared_layer", False)}
        shared = sum(2 * n * a.k_proj.out_features * b for a in attns
                     if getattr(a, "store_full_length_kv", False) and a.layer_type in read)
    return 2 * (per_layer + shared)
