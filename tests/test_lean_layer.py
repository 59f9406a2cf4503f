"""The lean decoder layer (models/lean_layer.py) computes what the family's HF layer computes.

FP32 on the CPU: the output, the input gradient and every parameter gradient of one layer's
recompute + backward within relative 1e-6 of `torch.autograd.grad` through the HF layer, per
family, for tiles of several sizes (one tile, a ragged last tile, one token a tile), causal,
with a padding mask and with packed documents' masks; the lean RMSNorm's forward is bit-identical to HF's in FP32 and BF16.

Kernels (models/lean_kernels.py): the choice and its errors on the CPU; the three swap points
(RMSNorm, SwiGLU product, rotary) exercised on the CPU with torch ops of the same contract;
Liger's kernels on CUDA (gpu-marked, skipped without liger-kernel) within BF16 noise of the
FP32 reference, as HF's own BF16 layer is.
"""
from __future__ import annotations

import importlib.util
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from transformers import GemmaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb

from slidetune.data.batch import document_positions
from slidetune.engine.config import RuntimeConfig
from slidetune.engine.slide.layer_runner import LayerRunner
from slidetune.models.lean_kernels import liger_kernels, resolve_lean_kernels
from slidetune.models.lean_layer import TORCH, LeanKernels, LeanLayers, lean_support, rms_norm, rope_support
from slidetune.models.load import RandomInit, skeleton
from slidetune.models.presets import tiny_config
from slidetune.models.units import SplitModel, run_layer
from slidetune.ops.packed_attention import use_packed_attention

LIGER_INSTALLED = importlib.util.find_spec("liger_kernel") is not None

FAMILIES = {"llama": {}, "qwen2": {}, "qwen3": {}, "mistral": {"sliding_window": 8}}


def _split(family: str, **kw) -> SplitModel:
    return SplitModel(skeleton(tiny_config(family, layers=2, vocab_size=128, **kw)))


def _params(split: SplitModel, i: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    unit = split.layer_units[i]
    flat = torch.empty(unit.numel)
    RandomInit(3, std=0.2, bias_std=0.1).fill(unit, flat)
    views = unit.views(flat.to(dtype))
    # norms away from 1 so their weight gradient matters
    return {k: (v + 0.3 * torch.randn_like(v) if "norm" in k else v).detach().requires_grad_(True)
            for k, v in views.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("tile", [1000, 7, 1])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("masking", ["causal", "padded", "documents"])
@pytest.mark.parametrize("row_tokens", [None, 24, 48], ids=["rows-all", "rows-1", "rows-2-ragged"])
def test_recompute_backward_matches_the_hf_layer(family, tile, masking, row_tokens):
    """The lean layer's recompute + backward against HF's layer (FP32): MLP tiles of several sizes
    (a ragged last one), row tiles of one sequence and of two (3 rows: a ragged last tile), causal,
    padded and packed-document masks."""
    torch.manual_seed(0)
    split = _split(family, **FAMILIES[family])
    B, S = 3, 24
    mask = positions = None
    if masking == "padded":
        mask = torch.ones(B, S, dtype=torch.long)
        mask[1, -5:] = 0
        mask[2, -11:] = 0
    if masking == "documents":                      # packed rows: attention within each document
        use_packed_attention(split.model)
        starts = torch.zeros(B, S, dtype=torch.bool)
        starts[:, 0] = starts[0, 9] = starts[1, 4] = starts[1, 15] = True
        positions = document_positions(starts)
    kwargs = split.layer_kwargs(B, S, torch.float32, torch.device("cpu"), attention_mask=mask,
                                position_ids=positions)
    if masking == "documents":
        assert kwargs[1]["attention_mask"] is not None
    params = _params(split, 1)
    x = torch.randn(B, S, split.hidden_size)
    dy = torch.randn(B, S, split.hidden_size)
    # the HF layer, before the lean norms are installed on these modules
    xr = x.clone().requires_grad_(True)
    ref_out = run_layer(split.layer_modules[1], params, xr, kwargs[1])
    ref = torch.autograd.grad(ref_out, [xr] + list(params.values()), dy)

    lean = LeanLayers(split.layer_modules, tile_tokens=tile, row_tokens=row_tokens)
    if row_tokens is not None and masking != "documents":
        assert len(lean._row_tiles(B, S, kwargs[1])) == -(-B // (row_tokens // S))
    out = lean.forward(1, {k: v.detach() for k, v in params.items()}, x, kwargs[1])
    assert _rel(out, ref_out.detach()) < 1e-6
    got = lean.recompute_backward(1, params, x, dy.clone(), kwargs[1])
    names = ["input"] + list(params)
    assert len(got) == len(ref)
    for name, g, r in zip(names, got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert _rel(g, r) < 1e-6, f"{family} tile {tile}: {name} relative difference {_rel(g, r):.2e}"
    # with the lean norms installed, the HF layer's own forward is unchanged
    again = run_layer(split.layer_modules[1], params, x, kwargs[1])
    assert torch.equal(again.detach(), ref_out.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_rms_norm_is_llamas_forward_and_its_gradient(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    torch.manual_seed(0)
    norm = LlamaRMSNorm(32, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.add_(torch.randn(32, dtype=dtype) * 0.3)
    x = (torch.randn(5, 7, 32) * 3).to(dtype).requires_grad_(True)
    g = torch.randn(5, 7, 32).to(dtype)
    ref = norm(x)
    rx, rw = torch.autograd.grad(ref, [x, norm.weight], g)
    out = rms_norm(x, norm.weight, norm.variance_epsilon)
    assert torch.equal(out, ref)                     # the same ops in the same order
    lx, lw = torch.autograd.grad(out, [x, norm.weight], g)
    tol = 1e-6 if dtype == torch.float32 else 1e-2   # BF16: one rounding of the result
    assert _rel(lx, rx) < tol and _rel(lw, rw) < tol


def test_lean_rms_norm_backward_in_row_chunks(monkeypatch):
    import slidetune.models.lean_layer as ll
    torch.manual_seed(1)
    x = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    g = torch.randn(37, 16)
    whole = torch.autograd.grad(rms_norm(x, w, 1e-5), [x, w], g)
    monkeypatch.setattr(ll, "_NORM_BACKWARD_ROWS", 8)      # 5 chunks, the last ragged
    chunked = torch.autograd.grad(rms_norm(x, w, 1e-5), [x, w], g)
    assert _rel(chunked[0], whole[0]) < 1e-6 and _rel(chunked[1], whole[1]) < 1e-6


def test_families_whose_layer_is_not_llamas_keep_the_hf_layer():
    # Gemma: (1 + w) RMSNorm and a scaled embedding; its layer is not Llama's arithmetic
    cfg = GemmaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    split = SplitModel(skeleton(cfg))
    why = lean_support(split.layer_modules[0])
    assert why is not None and "RMSNorm" in why
    with pytest.raises(ValueError, match="cannot run lean"):
        LeanLayers(split.layer_modules, tile_tokens=16)
    for family in FAMILIES:
        assert lean_support(_split(family).layer_modules[0]) is None


# ----------------------------------------------------------------------------- kernels
def test_kernel_choice_and_its_errors():
    assert resolve_lean_kernels("auto", "cpu") is TORCH and resolve_lean_kernels("auto", "cuda") is TORCH
    assert resolve_lean_kernels("torch", "cuda") is TORCH
    with pytest.raises(ValueError, match="CUDA only.*use torch"):
        resolve_lean_kernels("liger", "cpu")
    with pytest.raises(ValueError, match="lean_kernels must be"):
        resolve_lean_kernels("triton", "cpu")
    with pytest.raises(ValueError, match="lean_kernels must be auto, torch or liger"):
        RuntimeConfig(lean_kernels="fused")
    # the engine's path: the lean layer on the CPU with liger asked for
    split = _split("llama")
    rt = RuntimeConfig(mode="slide", device="cpu", lean_layer="on", lean_kernels="liger")
    with pytest.raises(ValueError, match="CUDA only"):
        LayerRunner(split, rt, torch.device("cpu"))
    # HF's layer does not use the lean kernels: nothing to refuse
    assert LayerRunner(split, RuntimeConfig(mode="slide", device="cpu", lean_layer="off", lean_kernels="liger"),
                       torch.device("cpu")).lean is None


@pytest.mark.skipif(LIGER_INSTALLED, reason="liger-kernel is installed here")
def test_liger_without_the_package_names_the_package_and_the_extra():
    with pytest.raises(ValueError, match=r"liger-kernel package \(pip install 'slidetune\[liger\]'\)"):
        resolve_lean_kernels("liger", "cuda")
    with pytest.raises(ValueError, match="liger-kernel"):
        liger_kernels()


def _counted(calls: Counter, name: str, fn):
    def op(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return op


def _torch_rope(q, k, cos, sin, unsqueeze_dim=1):
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_every_kernel_swap_point_runs_the_given_op_and_keeps_the_arithmetic(family):
    """The three ops replaced (norms, the MLP's product, the attention's rotary) by torch ops of
    the same contract, counted: each runs where it should, and the layer stays HF's to 1e-6."""
    torch.manual_seed(0)
    split = _split(family)
    B, S, tile = 2, 24, 20                       # 48 tokens: tiles of 20, 20 and 8
    kwargs = split.layer_kwargs(B, S, torch.float32, torch.device("cpu"))[1]
    params = _params(split, 1)
    x, dy = torch.randn(B, S, split.hidden_size), torch.randn(B, S, split.hidden_size)
    xr = x.clone().requires_grad_(True)
    ref_out = run_layer(split.layer_modules[1], params, xr, kwargs)
    ref = torch.autograd.grad(ref_out, [xr] + list(params.values()), dy)

    calls: Counter = Counter()
    probe = LeanKernels("probe", rms_norm=_counted(calls, "rms_norm", rms_norm),
                        silu_mul=_counted(calls, "silu_mul", lambda gate, up: F.silu(gate) * up),
                        rope=_counted(calls, "rope", _torch_rope))
    lean = LeanLayers(split.layer_modules, tile_tokens=tile, kernels=probe)
    assert lean.ops == {"rms_norm": "probe", "silu_mul": "probe", "rope": "probe"}
    got = lean.recompute_backward(1, params, x, dy.clone(), kwargs)
    for name, g, r in zip(["input"] + list(params), got, ref):
        assert _rel(g, r) < 1e-6, f"{family}: {name} relative difference {_rel(g, r):.2e}"
    # one attention recompute (input norm, Qwen3's q and k norms, the rotary), three MLP tiles
    qk_norms = 2 if family == "qwen3" else 0
    assert calls == Counter(rms_norm=1 + qk_norms + 3, silu_mul=3, rope=1)

    # a later LeanLayers on the same modules replaces these ops: torch's, HF's MLP and attention
    lean = LeanLayers(split.layer_modules, tile_tokens=tile)
    assert lean.ops == {"rms_norm": "torch", "silu_mul": "hf", "rope": "hf"}
    layer = split.layer_modules[1]
    assert "forward" not in vars(layer.mlp) and "forward" not in vars(layer.self_attn)
    calls.clear()
    got = lean.recompute_backward(1, params, x, dy.clone(), kwargs)
    assert not calls and all(_rel(g, r) < 1e-6 for g, r in zip(got, ref))


def test_a_module_the_kernels_cannot_replace_keeps_hfs_code():
    class UnrolledAttention(LlamaAttention):       # applies no apply_rotary_pos_emb of its own module
        def forward(self, hidden_states, **kwargs):
            return super().forward(hidden_states, **kwargs)
    config = tiny_config("llama", layers=2, vocab_size=128)
    config.hidden_act = "gelu"                     # a Llama MLP whose product is not SiLU's
    split = SplitModel(skeleton(config))
    assert rope_support(split.layer_modules[0].self_attn) is None
    assert "does not call apply_rotary_pos_emb" in rope_support(UnrolledAttention(split.config, 0))
    probe = LeanKernels("probe", rms_norm=rms_norm, silu_mul=lambda gate, up: F.silu(gate) * up, rope=_torch_rope)
    lean = LeanLayers(split.layer_modules, tile_tokens=8, kernels=probe)
    assert lean.ops["silu_mul"].startswith("hf: ") and "GELU" in lean.ops["silu_mul"].upper()
    assert lean.ops["rope"] == "probe"
    assert "forward" not in vars(split.layer_modules[0].mlp)


def test_the_swapped_rotary_compiles_once():
    """The attention's forward with another apply_rotary_pos_emb traces into one graph that the
    next calls reuse (no guard on the modeling module's own function fails)."""
    from torch._dynamo.testing import CompileCounter
    from slidetune.models.lean_layer import _parts
    torch._dynamo.reset()
    split = _split("qwen3")
    lean = LeanLayers(split.layer_modules, tile_tokens=8,
                      kernels=LeanKernels("probe", rms_norm=rms_norm, rope=_torch_rope))
    params = {k: v.detach() for k, v in _params(split, 1).items()}
    kwargs = split.layer_kwargs(2, 12, torch.float32, torch.device("cpu"))[1]
    x = torch.randn(2, 12, split.hidden_size)
    counter = CompileCounter()
    attention = torch.compile(LeanLayers.attention, backend=counter, dynamic=False)
    outs = [attention(split.layer_modules[1], _parts(params), x, kwargs) for _ in range(3)]
    assert counter.frame_count == 1
    assert torch.equal(outs[0], outs[2])
    assert _rel(outs[0], lean.attention(split.layer_modules[1], _parts(params), x, kwargs)) < 1e-6
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- Liger on CUDA
def _bf16_noise_case(family: str, tile: int, B: int = 2, S: int = 24):
    """(split, FP32 reference [out, grads...], HF's BF16 layer's [out, grads...], a run(lean) in BF16)."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    split = _split(family)
    params32 = {k: v.detach().to(dev).requires_grad_(True) for k, v in _params(split, 1).items()}
    params16 = {k: v.detach().to(torch.bfloat16).requires_grad_(True) for k, v in params32.items()}
    x = torch.randn(B, S, split.hidden_size, device=dev)
    dy = torch.randn(B, S, split.hidden_size, device=dev)
    kw32 = split.layer_kwargs(B, S, torch.float32, dev)[1]
    kw16 = split.layer_kwargs(B, S, torch.bfloat16, dev)[1]

    def hf(params, kw, dtype):
        xi = x.clone().to(dtype).requires_grad_(True)
        out = run_layer(split.layer_modules[1], params, xi, kw)
        return [out.detach()] + list(torch.autograd.grad(out, [xi] + list(params.values()), dy.to(dtype)))
    ref, hf16 = hf(params32, kw32, torch.float32), hf(params16, kw16, torch.bfloat16)

    def run(lean) -> list[torch.Tensor]:
        with torch.no_grad():
            out = lean.forward(1, {k: v.detach() for k, v in params16.items()}, x.bfloat16(), kw16)
        return [out] + list(lean.recompute_backward(1, params16, x.bfloat16(), dy.bfloat16().clone(), kw16))
    return split, ref, hf16, run


def _within_bf16_noise(got: list[torch.Tensor], ref: list[torch.Tensor], hf16: list[torch.Tensor], what: str):
    for i, (g, r, h) in enumerate(zip(got, ref, hf16)):
        noise = _rel(h, r)
        assert g.dtype == torch.bfloat16 and _rel(g, r) <= 2 * noise + 1e-3, \
            f"{what}: output {i} {_rel(g, r):.2e} from the FP32 reference, HF's BF16 layer {noise:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [1000, 20, 7])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_liger_kernels_within_bf16_noise(family, tile):
    """Liger's RMSNorm, SwiGLU and rotary in the lean layer, eager, one tile / ragged last tiles."""
    pytest.importorskip("liger_kernel")
    torch.backends.cuda.matmul.allow_tf32 = False
    split, ref, hf16, run = _bf16_noise_case(family, tile)
    torch_path = run(LeanLayers(split.layer_modules, tile_tokens=tile))
    _within_bf16_noise(torch_path, ref, hf16, f"{family} tile {tile} torch")
    lean = LeanLayers(split.layer_modules, tile_tokens=tile, kernels=liger_kernels())
    assert lean.ops == {"rms_norm": "liger", "silu_mul": "liger", "rope": "liger"}
    _within_bf16_noise(run(lean), ref, hf16, f"{family} tile {tile} liger")


@pytest.mark.gpu
def test_liger_block_kernels_within_bf16_noise():
    """8192 tokens: Qwen3's q/k norms cover 32768 rows of 16, where Liger's RMSNorm switches to
    its row-block kernels (rows >= 32768, width <= 256), as at Qwen3-8B's shapes."""
    pytest.importorskip("liger_kernel")
    torch.backends.cuda.matmul.allow_tf32 = False
    split, ref, hf16, run = _bf16_noise_case("qwen3", 3000, B=4, S=2048)
    _within_bf16_noise(run(LeanLayers(split.layer_modules, tile_tokens=3000, kernels=liger_kernels())),
                       ref, hf16, "qwen3 8192 tokens liger")


# dynamo tracing into Liger 0.8.5's Functions fails on torch 2.11 / Triton 3.6 (a Triton CompilationError,
# "'float' object has no attribute 'to'", then a guard error; H200 runs of 2026-11-26): the engine's
# default breaks the graph around each Liger call; strict, so a stack where tracing works says so
_TRACE_FAILS = pytest.mark.xfail(strict=True, reason="dynamo cannot trace Liger 0.8.5's Triton kernels on torch 2.11")


@pytest.mark.gpu
@pytest.mark.parametrize("under_compile", ["around", pytest.param("trace", marks=_TRACE_FAILS)])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_liger_kernels_compiled_within_bf16_noise(family, under_compile, monkeypatch):
    """The engine's path: LayerRunner with the lean layer compiled and lean_kernels liger (a graph
    break around each Liger call), and with dynamo tracing into Liger's Functions."""
    pytest.importorskip("liger_kernel")
    import slidetune.models.lean_kernels as lk
    monkeypatch.setattr(lk, "LIGER_UNDER_COMPILE", under_compile)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.reset()
    split, ref, hf16, run = _bf16_noise_case(family, 20)
    rt = RuntimeConfig(mode="slide", dtype="bf16", device="cuda", lean_layer="on", lean_kernels="liger",
                       compile_layers="on", mlp_tile_tokens=20)
    runner = LayerRunner(split, rt, torch.device("cuda"))
    assert runner.lean.kernels.name == ("liger" if under_compile == "around" else "liger-traced")

    class Compiled:                                   # the runner's compiled halves, as a LeanLayers
        forward = staticmethod(runner.forward)

        @staticmethod
        def recompute_backward(i, params, x, dy, kw):
            return runner.recompute_backward(i, params, x, dy, kw, None)
    for _ in range(2):                                # the second call runs the compiled graphs
        got = run(Compiled)
    _within_bf16_noise(got, ref, hf16, f"{family} compiled, Liger {under_compile}")
    torch._dynamo.reset()


def _document_mask_mod(doc: torch.Tensor):
    def mask_mod(b, h, q, kv):
        return (q >= kv) & (doc[b, q] == doc[b, kv])
    return mask_mod


def test_a_flex_block_mask_is_cut_by_rows_with_its_own_rows_mask():
    """Packed documents on CUDA reach the layer as a FlexAttention BlockMask: the row tiles cut its
    block tables and give it a mask_mod reading the original rows (BlockMask's own slicing leaves
    one that raises). Checked on the CPU: the sliced mask's blocks and mask_mod against the rows'."""
    from torch.nn.attention.flex_attention import create_block_mask
    from slidetune.models.lean_layer import _rows_cuttable, _rows_of
    B, S = 4, 256
    doc = torch.zeros(B, S, dtype=torch.int32)
    doc[0, 100:] = 1
    doc[1, 30:], doc[1, 200:] = 1, 2
    doc[3, 129:] = 1
    mask_mod = _document_mask_mod(doc)
    mask = create_block_mask(mask_mod, B, None, S, S, device="cpu", BLOCK_SIZE=128)
    assert _rows_cuttable({"attention_mask": mask, "position_ids": torch.zeros(B, S)}, B)
    q, kv = torch.arange(S)[None, None, :, None], torch.arange(S)[None, None, None, :]
    for r0, r1 in [(0, 2), (2, 4), (1, 3), (3, 4)]:
        rows = _rows_of({"attention_mask": mask}, r0, r1, B)["attention_mask"]
        assert torch.equal(rows.to_dense(), mask.to_dense()[r0:r1])
        b = torch.arange(r1 - r0)[:, None, None, None]
        h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
        assert torch.equal(rows.mask_mod(b, h, q, kv), mask_mod(b + r0, h, q, kv))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gpu_row_tiles_with_packed_documents_match_all_rows(family):
    """On CUDA, packed documents' BlockMask cut by rows: the lean layer in row tiles of one sequence
    gives what it gives over all rows at once (FP32, flex attention)."""
    torch.manual_seed(0)
    split = _split(family)
    use_packed_attention(split.model)
    B, S = 3, 256
    starts = torch.zeros(B, S, dtype=torch.bool)
    starts[:, 0] = starts[0, 100] = starts[1, 30] = starts[1, 200] = starts[2, 129] = True
    dev = torch.device("cuda")
    kwargs = split.layer_kwargs(B, S, torch.float32, dev, position_ids=document_positions(starts).to(dev))
    from torch.nn.attention.flex_attention import BlockMask
    assert isinstance(kwargs[1]["attention_mask"], BlockMask)
    params = {k: v.detach().to(dev).requires_grad_(True) for k, v in _params(split, 1).items()}
    x = torch.randn(B, S, split.hidden_size, device=dev)
    dy = torch.randn_like(x)
    got = {}
    for rows in (None, S):
        lean = LeanLayers(split.layer_modules, tile_tokens=100, row_tokens=rows)
        got[rows] = lean.recompute_backward(1, params, x, dy.clone(), kwargs[1])
    for a, b in zip(got[S], got[None]):
        assert _rel(a, b) < 1e-5
