"""FlatAdamW in the compact state formats (issue 46): a unit's moments kept in BF16 or 8-bit codes
with block scales, its master in FP32 or BF16, each range through native_adamw.update_compact."""
import pytest
import torch

from slidetune.engine import blockwise8, native_adamw
from slidetune.engine.adamw import FP32_ADAMW, AdamWConfig, FlatAdamW, optimizer_state

pytestmark = pytest.mark.skipif(native_adamw.load_compact() is None, reason="no C compiler with OpenMP")

B = blockwise8.BLOCK
CFG = AdamWConfig(lr=1e-3, weight_decay=0.1)
FORMATS = [("fp32", "bf16"), ("fp32", "8bit"), ("bf16", "fp32"), ("bf16", "bf16"), ("bf16", "8bit")]


def _grads(n, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen) * 1e-2).to(torch.bfloat16) for _ in range(steps)]


def _unit(master, moments, n, seed=3):
    fmt = optimizer_state(master, moments)
    p = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(fmt.master_dtype)
    return FlatAdamW(p, n_decay=n // 3, cfg=CFG, state_format=fmt, seed=17)


@pytest.mark.parametrize("master, moments", FORMATS)
def test_chunked_and_split_updates_equal_one_whole_call(master, moments):
    """A unit updated in block-aligned chunks as gradients arrive, or by the clipped sweep's pair
    (params over every chunk, then moments), keeps every bit of one whole-range call per step:
    the decay boundary inside a chunk, a clip coefficient."""
    n = 9 * B + 77
    whole, chunked, split = (_unit(master, moments, n) for _ in range(3))
    bounds = [0, 3 * B, 7 * B, n]
    for g in _grads(n, 3):
        for opt in (whole, chunked, split):
            opt.begin_step()
        whole.update(g, lr=1e-3, grad_scale=0.5)
        for lo, hi in zip(bounds, bounds[1:]):
            chunked.update(g[lo:hi], lr=1e-3, start=lo, grad_scale=0.5)
        for part in ("params", "moments"):
            for lo, hi in zip(bounds, bounds[1:]):
                split.update(g[lo:hi], lr=1e-3, start=lo, grad_scale=0.5, part=part)
    for other in (chunked, split):
        assert torch.equal(other.master.view(torch.uint8), whole.master.view(torch.uint8))
        for name, t in whole.state_tensors().items():
            assert torch.equal(other.state_tensors()[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("master, moments", FORMATS)
def test_state_is_the_format_and_tracks_fp32(master, moments):
    """The tensors are the format's (8-bit: codes and one scale a block of each moment) and
    their bytes are OptimizerState.nbytes; three steps stay near the FP32 unit's weights."""
    n = 5 * B + 3
    opt = _unit(master, moments, n)
    fmt = opt.state_format
    state = opt.state_tensors()
    assert state["exp_avg"].dtype == fmt.moment_dtype and opt.master.dtype == fmt.master_dtype
    assert (("exp_avg_scales" in state) == (moments == "8bit"))
    held = opt.master.nbytes + sum(t.nbytes for k, t in state.items() if k != "step")
    assert held == fmt.nbytes(n)
    ref = FlatAdamW(opt.master.float().clone(), n_decay=n // 3, cfg=CFG)
    for g in _grads(n, 3, seed=1):
        for o in (opt, ref):
            o.begin_step()
            o.update(g, lr=1e-3)
    # BF16 masters round each step to 8 bits of mantissa; the moments' rounding moves an update by
    # at most a few percent of lr
    tol = 2 ** -7 * ref.master.abs().max().item() if master == "bf16" else 3 * 1e-3 * 0.1
    assert (opt.master.float() - ref.master).abs().max().item() <= tol


def test_state_round_trips_and_a_mismatch_is_named():
    n = 3 * B
    a, b = _unit("fp32", "8bit", n), _unit("fp32", "8bit", n, seed=4)
    for g in _grads(n, 2):
        a.begin_step()
        a.update(g, lr=1e-3)
    b.load_state_tensors({k: t.clone() for k, t in a.state_tensors().items()})
    assert all(torch.equal(b.state_tensors()[k], t) for k, t in a.state_tensors().items())
    wrong = dict(a.state_tensors(), exp_avg=a.exp_avg.float())
    with pytest.raises(ValueError, match="exp_avg.*float32.*uint8"):
        b.load_state_tensors(wrong)


def test_what_it_cannot_hold_is_refused():
    fmt = optimizer_state("fp32", "8bit")
    p = torch.zeros(4 * B)
    with pytest.raises(ValueError, match="native AdamW kernel, not --tuning.host_adamw torch"):
        FlatAdamW(p, 0, CFG, state_format=fmt, kernel="torch")
    opt = FlatAdamW(p, 0, CFG, state_format=fmt)
    opt.begin_step()
    with pytest.raises(ValueError, match="block boundary: range start 100"):
        opt.update(torch.zeros(B, dtype=torch.bfloat16), lr=1e-3, start=100)
    with pytest.raises(ValueError, match="no weights pass"):
        opt.update(torch.zeros(B, dtype=torch.bfloat16), lr=1e-3, part="weights", weights=torch.zeros(B))
    away = FlatAdamW(None, 0, CFG, state_format=fmt, moments_here=False)
    away.begin_step()
    with pytest.raises(ValueError, match="update\\(\\) needs its range"):
        away.update(torch.zeros(B, dtype=torch.bfloat16), lr=1e-3)
    assert FlatAdamW(torch.zeros(8), 0, CFG).state_format is FP32_ADAMW


@pytest.mark.parametrize("master, moments", FORMATS)
def test_state_held_elsewhere_updates_as_its_own(master, moments):
    """The state where the disk tier and the ranks' shared mapping keep it: moments, scales and
    master handed to each update() (moments_here=False: the tier's block views, range by range),
    or given once as views (`state`: the shared mapping's), update every bit as a unit's own."""
    n = 9 * B + 77
    own = _unit(master, moments, n)
    fmt = own.state_format
    blocks = blockwise8.num_blocks(n)
    held = {name: torch.zeros(n, dtype=fmt.moment_dtype) for name in fmt.moment_names}
    held |= {name: torch.zeros(blocks, dtype=fmt.scale_dtype) for name in fmt.scale_names}
    master_away = own.master.clone()
    away = FlatAdamW(None, n // 3, CFG, state_format=fmt, moments_here=False, seed=17)
    views = (torch.zeros(n, dtype=fmt.moment_dtype), torch.zeros(n, dtype=fmt.moment_dtype), torch.zeros(()),
             *(torch.zeros(blocks, dtype=fmt.scale_dtype) for _ in fmt.scale_names))
    shared = FlatAdamW(own.master.clone(), n // 3, CFG, state_format=fmt, state=views, seed=17)
    bounds = [0, 4 * B, n]
    for g in _grads(n, 3):
        for opt in (own, away, shared):
            opt.begin_step()
        own.update(g, lr=1e-3, grad_scale=0.5)
        shared.update(g, lr=1e-3, grad_scale=0.5)
        for lo, hi in zip(bounds, bounds[1:]):
            scales = None
            if fmt.moment_block:
                scales = tuple(held[s][lo // B:-(-hi // B)] for s in fmt.scale_names)
            away.update(g[lo:hi], lr=1e-3, start=lo, grad_scale=0.5, params=master_away[lo:hi],
                        moments=(held["exp_avg"][lo:hi], held["exp_avg_sq"][lo:hi]), scales=scales)
    raw = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    assert torch.equal(raw(master_away), raw(own.master)) and torch.equal(raw(shared.master), raw(own.master))
    for name, t in own.state_tensors().items():
        if name != "step":
            assert torch.equal(raw(held[name]), raw(t)), name
        assert torch.equal(raw(shared.state_tensors()[name]), raw(t)), name
    assert away.state_names() == tuple(own.state_tensors()) and views[2] == 3
