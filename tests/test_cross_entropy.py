"""Output-layer loss ops: chunked (and fused, on GPU) against the full reference."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from allocator_peak import allocator_peak
from slidetune.ops.cross_entropy import IGNORE_INDEX, LogitTransform, available_impls, linear_cross_entropy

CUDA = torch.cuda.is_available()


def make_inputs(n=37, d=16, vocab=53, dtype=torch.float64, ignore_frac=0.3, bias=True, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, d, generator=g, dtype=torch.float64) / d**0.5
    b = torch.randn(vocab, generator=g, dtype=torch.float64) * 0.1 if bias else None
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignore_frac] = IGNORE_INDEX
    leaf = lambda t: None if t is None else t.to(device, dtype).requires_grad_()  # noqa: E731
    return leaf(hidden), leaf(weight), labels.to(device), leaf(b)


def loss_and_grads(hidden, weight, labels, bias, impl, scale=1.0, **kw):
    """Loss and the grads of scale * loss (scale checks that backward uses grad_output)."""
    tensors = [t for t in (hidden, weight, bias) if t is not None]
    for t in tensors:
        t.grad = None
    loss = linear_cross_entropy(hidden, weight, labels, impl=impl, bias=bias, **kw)
    (loss * scale).backward()
    return loss.detach(), [t.grad.clone() for t in tensors]


def assert_close(a, b, rtol):
    atol = rtol * max(b.abs().max().item(), 1e-30)  # relative to the tensor's scale
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def check_against_full(dtype, rtol, chunk_tokens, **make_kw):
    hidden, weight, labels, bias = make_inputs(dtype=dtype, **make_kw)
    ref_loss, ref_grads = loss_and_grads(hidden, weight, labels, bias, "full", scale=0.37)
    loss, grads = loss_and_grads(hidden, weight, labels, bias, "chunked", scale=0.37, chunk_tokens=chunk_tokens)
    assert loss.dtype == torch.promote_types(dtype, torch.float32) and loss.dim() == 0
    assert_close(loss, ref_loss, rtol)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert_close(g, r, rtol)


# ---------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 1e-6)])
@pytest.mark.parametrize("chunk_tokens", [1, 5, 8, 37, 1000])  # 5, 8: do not divide N=37
@pytest.mark.parametrize("ignore_frac", [0.0, 0.3, 0.9])
@pytest.mark.parametrize("bias", [True, False])
def test_chunked_matches_full(dtype, rtol, chunk_tokens, ignore_frac, bias):
    check_against_full(dtype, rtol, chunk_tokens, ignore_frac=ignore_frac, bias=bias)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_all_ignored(dtype):
    hidden, weight, labels, bias = make_inputs(dtype=dtype, ignore_frac=1.1)
    assert (labels == IGNORE_INDEX).all()
    for impl in ("full", "chunked"):
        loss, grads = loss_and_grads(hidden, weight, labels, bias, impl, chunk_tokens=8)
        assert loss.item() == 0.0
        for g in grads:
            assert torch.count_nonzero(g) == 0


def test_empty_batch():
    hidden, weight, labels, bias = make_inputs(n=0, dtype=torch.float32)
    loss, grads = loss_and_grads(hidden, weight, labels, bias, "chunked")
    assert loss.item() == 0.0 and grads[0].shape == (0, 16)


def test_single_chunk_and_multi_chunk_agree_fp32():
    # one chunk: grad_weight from one matmul; several: fp32 accumulation across chunks
    hidden, weight, labels, bias = make_inputs(n=64, dtype=torch.float32)
    _, one = loss_and_grads(hidden, weight, labels, bias, "chunked", chunk_tokens=64)
    _, many = loss_and_grads(hidden, weight, labels, bias, "chunked", chunk_tokens=7)
    for a, b in zip(one, many):
        assert_close(a, b, 1e-6)


def test_leading_dims_are_flattened():
    hidden, weight, labels, bias = make_inputs(n=24, dtype=torch.float64)
    ref = linear_cross_entropy(hidden, weight, labels, impl="full", bias=bias)
    out = linear_cross_entropy(hidden.view(4, 6, -1), weight, labels.view(4, 6), chunk_tokens=5, bias=bias)
    assert_close(out, ref, 1e-12)


def test_gradcheck_chunked():
    hidden, weight, labels, bias = make_inputs(n=6, d=3, vocab=7, dtype=torch.float64, ignore_frac=0.3, seed=3)
    labels[1] = IGNORE_INDEX

    def f(h, w, b):
        return linear_cross_entropy(h, w, labels, impl="chunked", chunk_tokens=2, bias=b)

    assert torch.autograd.gradcheck(f, (hidden, weight, bias), eps=1e-6, atol=1e-8)


def test_only_some_inputs_require_grad():
    hidden, weight, labels, bias = make_inputs(dtype=torch.float64)
    weight.requires_grad_(False)
    bias.requires_grad_(False)
    ref = torch.autograd.grad(linear_cross_entropy(hidden, weight, labels, impl="full", bias=bias), hidden)[0]
    out = torch.autograd.grad(linear_cross_entropy(hidden, weight, labels, chunk_tokens=4, bias=bias), hidden)[0]
    assert_close(out, ref, 1e-10)


def test_retain_graph_backward_twice():
    hidden, weight, labels, bias = make_inputs(dtype=torch.float64)
    loss = linear_cross_entropy(hidden, weight, labels, chunk_tokens=4, bias=bias)
    loss.backward(retain_graph=True)
    g1 = weight.grad.clone()
    loss.backward()
    assert_close(weight.grad, 2 * g1, 1e-12)


# ---------------------------------------------------------------------------- bf16


def test_bf16_within_bf16_noise_of_fp32_reference():
    h64, w64, labels, b64 = make_inputs(n=96, d=64, vocab=300, dtype=torch.float64, ignore_frac=0.2)
    as_ = lambda t, dt: t.detach().to(dt).requires_grad_()  # noqa: E731
    hb, wb, bb = (as_(t, torch.bfloat16) for t in (h64, w64, b64))
    # reference: fp32 math on the very same (bf16-rounded) inputs
    hf, wf, bf = (as_(t, torch.float32) for t in (hb, wb, bb))
    ref_loss, ref_grads = loss_and_grads(hf, wf, labels, bf, "full")
    for impl in ("full", "chunked"):
        loss, grads = loss_and_grads(hb, wb, labels, bb, impl, chunk_tokens=16)
        assert loss.dtype == torch.float32
        assert abs(loss.item() - ref_loss.item()) <= 1e-2 * abs(ref_loss.item())
        for g, r in zip(grads, ref_grads):
            assert g.dtype == torch.bfloat16
            rel = (g.float() - r).norm() / r.norm()
            assert rel < 2e-2, (impl, rel.item())


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
def test_backward_scale_is_not_rounded_to_bf16(device):
    # loss / num_tokens: the scale must multiply in fp32, then round once to bf16
    hidden, weight, labels, bias = make_inputs(n=64, d=32, vocab=200, dtype=torch.bfloat16, device=device)
    s = 1 / 3000
    _, unit = loss_and_grads(hidden, weight, labels, bias, "chunked", chunk_tokens=16)
    _, scaled = loss_and_grads(hidden, weight, labels, bias, "chunked", scale=s, chunk_tokens=16)
    for u, g in zip(unit, scaled):
        assert torch.equal(g, (u.float() * torch.tensor(s, dtype=torch.float32)).to(torch.bfloat16))


# ---------------------------------------------------------------------------- ignored rows


class _LinearSpy(TorchFunctionMode):
    """Records the rows of every F.linear call and checks no earlier logits are alive."""

    def __init__(self):
        super().__init__()
        self.rows, self.outputs, self.funcs = [], [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.funcs.append(getattr(func, "__name__", str(func)))
        if func is F.linear:
            alive = [r for r in self.outputs if r() is not None]
            assert not alive, "a previous chunk of logits is still alive"
            self.rows.append(args[0].shape[0])
            out = func(*args, **kwargs)
            self.outputs.append(weakref.ref(out))
            return out
        return func(*args, **kwargs)


@pytest.mark.parametrize("chunk_tokens", [4, 64])
def test_ignored_rows_never_reach_the_matmul(chunk_tokens):
    hidden, weight, labels, bias = make_inputs(n=40, dtype=torch.float32, ignore_frac=0.5)
    n_valid = int((labels != IGNORE_INDEX).sum())
    with _LinearSpy() as spy:
        loss = linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk_tokens, bias=bias)
    assert sum(spy.rows) == n_valid
    assert max(spy.rows) <= chunk_tokens
    assert torch.isfinite(loss)


def test_nan_in_ignored_rows_has_no_effect():
    hidden, weight, labels, bias = make_inputs(n=40, dtype=torch.float64, ignore_frac=0.5)
    ignored = labels == IGNORE_INDEX
    ref_loss, ref_grads = loss_and_grads(hidden, weight, labels, bias, "chunked", chunk_tokens=6)
    with torch.no_grad():
        hidden[ignored] = float("nan")
    loss, grads = loss_and_grads(hidden, weight, labels, bias, "chunked", chunk_tokens=6)
    assert torch.equal(loss, ref_loss)
    assert torch.equal(grads[0][ignored], torch.zeros_like(grads[0][ignored]))  # exactly zero rows
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)


# ---------------------------------------------------------------------------- memory


def test_chunked_saves_only_grad_sized_tensors():
    n, d, vocab = 50, 8, 97
    hidden, weight, labels, bias = make_inputs(n=n, d=d, vocab=vocab, dtype=torch.float32)
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = linear_cross_entropy(hidden, weight, labels, chunk_tokens=8, bias=bias)
    assert sorted(shapes) == sorted([(n, d), (vocab, d), (vocab,)])
    loss.backward()

    shapes.clear()  # the reference keeps an [N, V] tensor for backward
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        linear_cross_entropy(hidden, weight, labels, impl="full", bias=bias)
    assert (n, vocab) in shapes


def test_no_grad_work_without_grad():
    hidden, weight, labels, bias = make_inputs(dtype=torch.float32)
    ref = linear_cross_entropy(hidden, weight, labels, impl="full", bias=bias)
    for ctx, args in [
        (torch.no_grad(), (hidden, weight, bias)),
        (torch.enable_grad(), (hidden.detach(), weight.detach(), bias.detach())),
    ]:
        with ctx, _LinearSpy() as spy:
            out = linear_cross_entropy(args[0], args[1], labels, chunk_tokens=8, bias=args[2])
        assert out.grad_fn is None
        assert_close(out, ref.detach(), 1e-6)
        assert not {"mm", "addmm_", "index_copy_", "matmul", "__matmul__"} & set(spy.funcs), spy.funcs


# ---------------------------------------------------------------------------- impls


@pytest.mark.skipif(CUDA, reason="checks the CPU-only listing")
def test_available_impls_cpu():
    assert available_impls() == ["full", "chunked"]
    hidden, weight, labels, bias = make_inputs(dtype=torch.float32)
    with pytest.raises(RuntimeError, match="Available impls: \\['full', 'chunked'\\]"):
        linear_cross_entropy(hidden, weight, labels, impl="fused")


def test_bad_arguments():
    hidden, weight, labels, bias = make_inputs(dtype=torch.float32)
    with pytest.raises(ValueError, match="unknown impl"):
        linear_cross_entropy(hidden, weight, labels, impl="nope")
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_cross_entropy(hidden, weight, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(hidden, weight, labels[:-1])


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("impl", ["chunked", "fused"])
@pytest.mark.parametrize("ignore_frac", [0.0, 0.3, 1.1])
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_fp32_matches_full(impl, ignore_frac, bias):
    if impl not in available_impls():
        pytest.skip(f"{impl} not available")
    # V not a multiple of the Triton block; chunk does not divide N
    hidden, weight, labels, b = make_inputs(
        n=300, d=64, vocab=10_007, dtype=torch.float32, ignore_frac=ignore_frac, bias=bias, device="cuda"
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_loss, ref_grads = loss_and_grads(hidden, weight, labels, b, "full", scale=0.5)
    loss, grads = loss_and_grads(hidden, weight, labels, b, impl, scale=0.5, chunk_tokens=128)
    assert_close(loss, ref_loss, 1e-5)
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("impl", ["chunked", "fused"])
def test_gpu_bf16_within_noise_of_fp32_reference(impl):
    if impl not in available_impls():
        pytest.skip(f"{impl} not available")
    h, w, labels, b = make_inputs(n=1000, d=256, vocab=32_003, dtype=torch.bfloat16, ignore_frac=0.2, device="cuda")
    hf, wf, bf = (t.detach().float().requires_grad_() for t in (h, w, b))
    ref_loss, ref_grads = loss_and_grads(hf, wf, labels, bf, "full")
    full_loss, full_grads = loss_and_grads(h, w, labels, b, "full")
    loss, grads = loss_and_grads(h, w, labels, b, impl, chunk_tokens=256)
    assert abs(loss.item() - ref_loss.item()) <= 2e-3 * abs(ref_loss.item())
    for g, r, fg in zip(grads, ref_grads, full_grads):
        assert g.dtype == torch.bfloat16
        rel = ((g.float() - r).norm() / r.norm()).item()
        rel_full = ((fg.float() - r).norm() / r.norm()).item()
        assert rel < max(2 * rel_full, 1e-2), (rel, rel_full)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_fused_peak_memory_below_full():
    if "fused" not in available_impls():
        pytest.skip("fused not available")
    n, d, vocab = 4096, 512, 65_536
    h, w, labels, _ = make_inputs(n=n, d=d, vocab=vocab, dtype=torch.bfloat16, bias=False, device="cuda")
    peaks = {}
    for impl in ("full", "chunked", "fused"):
        loss_and_grads(h, w, labels, None, impl, chunk_tokens=1024)  # warm-up (Triton compile)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss_and_grads(h, w, labels, None, impl, chunk_tokens=1024)
        torch.cuda.synchronize()
        peaks[impl] = torch.cuda.max_memory_allocated() - base
    logits_bf16 = n * vocab * 2
    assert peaks["full"] > 3 * logits_bf16, peaks
    assert peaks["chunked"] < peaks["full"] / 2, peaks
    assert peaks["fused"] <= peaks["chunked"], peaks


@pytest.mark.parametrize("transform", [LogitTransform(scale=0.125), LogitTransform(softcap=2.0),
                                       LogitTransform(scale=4.0, softcap=3.0)], ids=["scale", "softcap", "both"])
def test_logit_transform_matches_autograd(transform):
    """Granite/Cohere scaling and Gemma softcapping: loss and gradients equal plain autograd."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(24, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(40, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 40, (24,), generator=g)
    labels[:5] = -100
    want = F.cross_entropy(transform.apply(F.linear(hidden, weight, bias)), labels, ignore_index=-100,
                           reduction="sum")
    want_grads = torch.autograd.grad(want, (hidden, weight, bias))
    for impl, kw in (("full", {}), ("chunked", {"chunk_tokens": 7})):
        loss = linear_cross_entropy(hidden, weight, labels, impl=impl, bias=bias, transform=transform, **kw)
        grads = torch.autograd.grad(loss, (hidden, weight, bias))
        torch.testing.assert_close(loss, want)
        for got, ref in zip(grads, want_grads):
            torch.testing.assert_close(got, ref)


# ---------------------------------------------------------------------------- the final norm in the chunks


def _rms_norm(x, params, eps=1e-6):
    """HF's RMSNorm (Llama/Qwen): FP32 statistics, the weight times the input dtype's normed x."""
    xf = x.float() if x.dtype != torch.float64 else x
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return params["weight"] * normed.to(x.dtype)


def _layer_norm(x, params):
    return F.layer_norm(x, x.shape[-1:], params["weight"], params["bias"], 1e-5)


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk_tokens", [1, 5, 37, 1000])     # 5: a ragged last chunk
@pytest.mark.parametrize("ignore_frac", [0.0, 0.3])
@pytest.mark.parametrize("norm_kind", ["rms", "layer"])
@pytest.mark.parametrize("path", ["autograd", "direct"])
def test_norm_inside_chunks_matches_norm_then_full(dtype, rtol, chunk_tokens, ignore_frac, norm_kind, path):
    """The final norm applied chunk by chunk (RowNorm) gives the loss and every gradient (hidden,
    weight, bias, the norm's parameters) of the norm over all tokens followed by the full head,
    through autograd and through linear_cross_entropy_grads (no graph, scaled in place)."""
    from slidetune.ops.cross_entropy import RowNorm, linear_cross_entropy_grads
    hidden, weight, labels, bias = make_inputs(dtype=dtype, ignore_frac=ignore_frac, seed=11)
    g = torch.Generator().manual_seed(12)
    d = hidden.shape[1]
    fn = _rms_norm if norm_kind == "rms" else _layer_norm
    params = {"weight": (1 + 0.1 * torch.randn(d, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()}
    if norm_kind == "layer":
        params["bias"] = (0.1 * torch.randn(d, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    wrt = [hidden, weight, bias, *params.values()]
    scale = 0.37
    ref_loss = linear_cross_entropy(fn(hidden, params), weight, labels, impl="full", bias=bias)
    ref = torch.autograd.grad(ref_loss * scale, wrt)
    if path == "autograd":
        loss = linear_cross_entropy(hidden, weight, labels, impl="chunked", chunk_tokens=chunk_tokens, bias=bias,
                                    norm=RowNorm(fn, params))
        got = torch.autograd.grad(loss * scale, wrt)
    else:
        loss, g_h, g_w, g_b, g_n = linear_cross_entropy_grads(
            hidden.detach(), weight.detach(), labels, scale, impl="chunked", chunk_tokens=chunk_tokens,
            bias=bias.detach(), norm=RowNorm(fn, {k: p.detach() for k, p in params.items()}))
        assert not loss.requires_grad and not g_h.requires_grad and list(g_n) == list(params)
        got = [g_h, g_w, g_b, *g_n.values()]
    assert_close(loss.detach(), ref_loss.detach(), rtol)
    for a, r in zip(got, ref):
        assert a.dtype == r.dtype and a.shape == r.shape
        assert_close(a, r, rtol)


def test_direct_grads_of_the_full_head_match_autograd():
    """linear_cross_entropy_grads with impl="full" (autograd inside) returns what autograd gives."""
    from slidetune.ops.cross_entropy import RowNorm, linear_cross_entropy_grads
    hidden, weight, labels, bias = make_inputs(dtype=torch.float64, seed=4)
    params = {"weight": torch.linspace(0.5, 1.5, hidden.shape[1], dtype=torch.float64).requires_grad_()}
    ref_loss = linear_cross_entropy(_rms_norm(hidden, params), weight, labels, impl="full", bias=bias)
    ref = torch.autograd.grad(ref_loss * 0.5, [hidden, weight, bias, params["weight"]])
    loss, g_h, g_w, g_b, g_n = linear_cross_entropy_grads(hidden.detach(), weight.detach(), labels, 0.5, impl="full",
                                                          bias=bias.detach(),
                                                          norm=RowNorm(_rms_norm, {"weight": params["weight"].detach()}))
    torch.testing.assert_close(loss, ref_loss.detach())
    for a, r in zip([g_h, g_w, g_b, g_n["weight"]], ref):
        torch.testing.assert_close(a, r)


def test_norm_inside_chunks_keeps_no_normed_copy_of_all_tokens():
    """Memory: with the norm inside the chunks, the head's peak above its inputs no longer holds the
    normed hidden states and their FP32 upcast for all N tokens (HF's norm then the chunked head)."""
    from slidetune.ops.cross_entropy import RowNorm, linear_cross_entropy_grads
    n, d, vocab = 4096, 256, 512
    hidden, weight, labels, bias = make_inputs(n=n, d=d, vocab=vocab, dtype=torch.float32, ignore_frac=0.0,
                                               bias=False)
    params = {"weight": torch.ones(d)}
    peaks = {}
    for way in ("outside", "inside"):
        def run():
            if way == "outside":
                h = _rms_norm(hidden.detach().requires_grad_(), params)
                linear_cross_entropy_grads(h.detach(), weight.detach(), labels, 1.0, chunk_tokens=256)
            else:
                linear_cross_entropy_grads(hidden.detach(), weight.detach(), labels, 1.0, chunk_tokens=256,
                                           norm=RowNorm(_rms_norm, params))
        peaks[way] = allocator_peak(run)
    # outside holds the normed copy of all tokens (n*d*4 bytes) beyond the inside way's chunk graphs
    # (measured: 6.6 vs 10.0 MB, 0.81 of the copy)
    assert peaks["inside"] + 0.75 * n * d * 4 <= peaks["outside"], peaks


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("impl", ["chunked", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_direct_grads_with_norm_match_reference(impl, dtype):
    """The slide engine's head (the final norm inside the chunks, gradients without a graph, scaled in
    place) on the GPU: FP32 within 1e-5 of the full head after the norm; BF16 within the noise of
    BF16's own full head against an FP32 reference."""
    from slidetune.ops.cross_entropy import RowNorm, linear_cross_entropy_grads
    if impl not in available_impls():
        pytest.skip(f"{impl} not available")
    torch.backends.cuda.matmul.allow_tf32 = False
    h, w, labels, b = make_inputs(n=1000, d=256, vocab=32_003, dtype=dtype, ignore_frac=0.2, device="cuda")
    norm_w = (1 + 0.1 * torch.randn(256, device="cuda")).to(dtype).requires_grad_()

    def reference(h, w, b, nw):
        loss = linear_cross_entropy(_rms_norm(h, {"weight": nw}), w, labels, impl="full", bias=b)
        return loss.detach(), torch.autograd.grad(loss * 0.25, [h, w, b, nw])

    ref_loss, ref = reference(*(t.detach().float().requires_grad_() for t in (h, w, b, norm_w)))
    own_loss, own = reference(h, w, b, norm_w)
    loss, g_h, g_w, g_b, g_n = linear_cross_entropy_grads(h.detach(), w.detach(), labels, 0.25, impl=impl,
                                                          chunk_tokens=256, bias=b.detach(),
                                                          norm=RowNorm(_rms_norm, {"weight": norm_w.detach()}))
    got = [g_h, g_w, g_b, g_n["weight"]]
    if dtype == torch.float32:
        assert_close(loss, ref_loss, 1e-5)
        for g, r in zip(got, ref):
            assert_close(g, r, 1e-5)
        return
    assert abs(loss.item() - ref_loss.item()) <= 2e-3 * abs(ref_loss.item())
    for g, r, o in zip(got, ref, own):
        assert g.dtype == torch.bfloat16
        rel = ((g.float() - r).norm() / r.norm()).item()
        rel_own = ((o.float() - r).norm() / r.norm()).item()
        assert rel < max(2 * rel_own, 1e-2), (rel, rel_own)


# ---------------------------------------------------------------------------- per-token passes


@pytest.mark.parametrize("impl", ["full", "chunked"])
@pytest.mark.parametrize("chunk_tokens", [1, 5, 1000])
@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(scale=0.5, softcap=2.0)], ids=["id", "cap"])
def test_token_losses_are_the_rows_the_head_sums(impl, chunk_tokens, transform):
    """linear_token_losses: each token's CE, 0 for ignored ones, the rows linear_cross_entropy sums,
    with the final norm inside the chunks too."""
    from slidetune.ops.cross_entropy import RowNorm, linear_token_losses
    hidden, weight, labels, bias = (t.detach() if t is not None else None for t in make_inputs(seed=5))
    params = {"weight": 1 + 0.1 * torch.randn(hidden.shape[1], dtype=torch.float64)}
    normed = _rms_norm(hidden, params)
    rows = linear_token_losses(hidden, weight, labels, impl, chunk_tokens, bias, transform, RowNorm(_rms_norm, params))
    ref = F.cross_entropy(transform.apply(F.linear(normed, weight, bias)), labels, ignore_index=IGNORE_INDEX,
                          reduction="none")
    assert rows.shape == labels.shape and not rows.requires_grad
    assert_close(rows, ref, 1e-12)
    assert (rows[labels == IGNORE_INDEX] == 0).all()
    total = linear_cross_entropy(hidden, weight, labels, impl=impl, chunk_tokens=chunk_tokens, bias=bias,
                                 transform=transform, norm=RowNorm(_rms_norm, params))
    assert_close(rows.sum(), total, 1e-12)


@pytest.mark.parametrize("impl", ["full", "chunked"])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 1000])
@pytest.mark.parametrize("objective", ["dpo", "ipo", "simpo", "orpo"])
def test_two_passes_give_the_preference_losss_gradients(impl, chunk_tokens, objective):
    """The preference head in two passes (token CE, then gradients with each token scaled by minus
    its sequence's coefficient) gives autograd's gradients of the preference term through the full
    logits: hidden, weight, bias and the norm's parameters, FP64, ignored (prompt) tokens present."""
    from slidetune.objectives.preference import PreferenceConfig, coefficients, pair_loss
    from slidetune.ops.cross_entropy import RowNorm, linear_cross_entropy_grads, linear_token_losses
    seqs, length = 6, 9                                        # 3 pairs: rows 0-2 chosen, 3-5 rejected
    hidden, weight, labels, bias = make_inputs(n=seqs * length, ignore_frac=0.3, seed=7)
    params = {"weight": (1 + 0.1 * torch.randn(hidden.shape[1], dtype=torch.float64)).requires_grad_()}
    seq_of = torch.arange(seqs * length) // length             # [N] each token's sequence
    cfg = PreferenceConfig(objective, beta=0.3)
    ref_logps = torch.randn(seqs, dtype=torch.float64) * 3 - 20

    def sums(token_ce):                                        # [N] -> the sequences' log-prob sums [S]
        return -torch.zeros(seqs, dtype=token_ce.dtype).index_add(0, seq_of, token_ce)
    tokens = torch.zeros(seqs, dtype=torch.long).index_add(0, seq_of, (labels != IGNORE_INDEX).long())
    # autograd through the full logits
    wrt = [hidden, weight, bias, params["weight"]]
    rows = F.cross_entropy(F.linear(_rms_norm(hidden, params), weight, bias), labels, ignore_index=IGNORE_INDEX,
                           reduction="none")
    ref = torch.autograd.grad(pair_loss(cfg, sums(rows), tokens, ref_logps).loss, wrt)
    # the two passes
    norm = RowNorm(_rms_norm, {"weight": params["weight"].detach()})
    token_ce = linear_token_losses(hidden.detach(), weight.detach(), labels, impl, chunk_tokens, bias.detach(),
                                   norm=norm)
    out, coef = coefficients(cfg, sums(token_ce), tokens, ref_logps)
    row_scale = -coef[seq_of]                                  # d loss / d CE_t = -d loss / d logp_seq
    _, g_h, g_w, g_b, g_n = linear_cross_entropy_grads(hidden.detach(), weight.detach(), labels, row_scale, impl,
                                                       chunk_tokens, bias.detach(), norm=norm)
    assert out.loss.item() == pytest.approx(pair_loss(cfg, sums(rows.detach()), tokens, ref_logps).loss.item())
    for got, want in zip([g_h, g_w, g_b, g_n["weight"]], ref):
        assert_close(got, want, 1e-10)


def test_a_per_token_scale_must_cover_every_token():
    from slidetune.ops.cross_entropy import linear_cross_entropy_grads
    hidden, weight, labels, bias = (t.detach() if t is not None else None for t in make_inputs())
    with pytest.raises(ValueError, match=r"scale \(5,\) does not match labels \(37,\)"):
        linear_cross_entropy_grads(hidden, weight, labels, torch.ones(5, dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("impl", ["chunked", "fused"])
def test_gpu_token_losses_and_per_token_scale_match_reference(impl):
    """The preference head's two passes on the GPU, with the Triton kernel's per-row losses: each
    token's CE and the gradients of sum_t scale[t] x CE_t (the final norm inside the chunks) within
    1e-5 of the full head's in FP32, V not a multiple of the Triton block, chunks not dividing N."""
    from slidetune.ops.cross_entropy import RowNorm, linear_cross_entropy_grads, linear_token_losses
    if impl not in available_impls():
        pytest.skip(f"{impl} not available")
    torch.backends.cuda.matmul.allow_tf32 = False
    h, w, labels, b = make_inputs(n=1000, d=256, vocab=32_003, dtype=torch.float32, ignore_frac=0.2, device="cuda")
    norm_w = (1 + 0.1 * torch.randn(256, device="cuda")).requires_grad_()
    scale = torch.randn(1000, device="cuda", dtype=torch.float32)          # [N] each token's factor
    rows = F.cross_entropy(F.linear(_rms_norm(h, {"weight": norm_w}), w, b), labels, ignore_index=IGNORE_INDEX,
                           reduction="none")
    ref = torch.autograd.grad((rows * scale).sum(), [h, w, b, norm_w])
    norm = RowNorm(_rms_norm, {"weight": norm_w.detach()})
    got_rows = linear_token_losses(h.detach(), w.detach(), labels, impl, 256, b.detach(), norm=norm)
    assert_close(got_rows, rows.detach(), 1e-5)
    loss, g_h, g_w, g_b, g_n = linear_cross_entropy_grads(h.detach(), w.detach(), labels, scale, impl, 256,
                                                          b.detach(), norm=norm)
    assert_close(loss, rows.detach().sum(), 1e-5)
    for got, want in zip([g_h, g_w, g_b, g_n["weight"]], ref):
        assert_close(got, want, 1e-5)
