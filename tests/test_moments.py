"""--moments bf16|8bit and --master bf16 (issue 46): the host units' AdamW state kept compact, end to
end through the slide engine: what it holds, an exact resume, a checkpoint of another format refused
naming it, the plan's bytes, and the combinations it does not run yet refused before anything is built."""
from __future__ import annotations

import json

import pytest
import torch

from slidetune.checkpoint import CheckpointError, checkpoint_dir, load_checkpoint, save_checkpoint
from slidetune.engine import RuntimeConfig, native_adamw
from slidetune.engine.adamw import FP32_ADAMW, optimizer_state
from slidetune.engine.fit import estimate_memory
from slidetune.engine.placement import PlacementPlan, unit_shapes
from test_checkpoint import make_engine, masters, optim, shut, train
from test_checkpoint_integrity import assert_bit_exact
from test_disk_tier import state as _state
from test_train_errors import COMMON, run_cli, small_corpus  # noqa: F401 (small_corpus: COMMON's --data)

pytestmark = pytest.mark.skipif(native_adamw.load_compact() is None, reason="no C compiler with OpenMP")


@pytest.fixture
def engines():
    made = []

    def factory(*a, **kw):
        made.append(make_engine(*a, **kw))
        return made[-1]
    yield factory
    for e in made:
        shut(e)


def _identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].reshape(-1).view(torch.uint8),
                                                        b[k].reshape(-1).view(torch.uint8)), k


FORMATS = [("fp32", "bf16"), ("fp32", "8bit"), ("bf16", "fp32"), ("bf16", "8bit")]


@pytest.mark.parametrize("master, moments", FORMATS)
def test_host_units_hold_the_format_and_train_near_fp32(engines, master, moments):
    """Every host unit's moments are in the format (8-bit: with their block scales); a unit updated on
    the GPU side (device_layers) keeps FP32; over six steps on random batches the losses follow the FP32
    run's within 0.2% (1% with a BF16 master; the quality on a real fine-tune is the quality run's)."""
    clip = dict(grad_accum=1, max_grad_norm=1.0)          # the default recipe: the clipped split sweep
    ref = engines(**clip, runtime={"device_layers": 1})
    eng = engines(**clip, runtime={"device_layers": 1, "moments": moments, "master": master})
    fmt = optimizer_state(master, moments)
    for unit in eng.units:
        want = FP32_ADAMW if unit.on_device else fmt
        assert unit.opt.state_format is want, unit.spec.name
        assert unit.tier.ram_bytes_per_param == (want.bytes_per_param if unit.on_host else unit.tier.ram_bytes_per_param)
    assert {u.master.dtype for u in eng.units if u.on_host} == {fmt.master_dtype}
    state = optim(eng)
    assert state["layer.1.exp_avg"].dtype == fmt.moment_dtype and state["layer.0.exp_avg"].dtype == torch.float32
    assert ("layer.1.exp_avg_scales" in state) == (moments == "8bit")
    losses, ref_losses = train(eng, range(6)), train(ref, range(6))
    if master == "fp32":
        assert losses[0] == ref_losses[0]                   # the first forward: the same weights
    # a BF16 master: its weights rounded to BF16 from the first step (8 bits of mantissa: 0.5% here)
    tol = 2e-3 if master == "fp32" else 1e-2
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < tol, (losses, ref_losses)


@pytest.mark.parametrize("master, moments", FORMATS)
def test_resume_is_exact_in_the_format(tmp_path, engines, master, moments):
    """Saved at step 2 and resumed into an engine of another initialisation: steps 3-4 repeat the
    uninterrupted run's losses, masters and compact moments in every bit."""
    kw = dict(grad_accum=2, max_grad_norm=0.5, runtime={"moments": moments, "master": master})
    ref = engines(**kw)
    ref_losses = train(ref, range(4), 2)
    first = engines(**kw)
    losses = train(first, range(2), 2)
    ckpt = save_checkpoint(first, checkpoint_dir(tmp_path, 2), step=2, trainer_state={})
    resumed = engines(**kw, seed=99)
    load_checkpoint(resumed, ckpt)
    losses += train(resumed, range(2, 4), 2)
    assert losses == ref_losses
    _identical(masters(resumed), masters(ref))
    _identical(optim(resumed), optim(ref))

    fp32 = engines(seed=99)
    want = (f"the --moments it was saved with: this one holds --moments {moments}" if moments != "fp32"
            else "saved with --master bf16, and this run keeps --master fp32")
    with pytest.raises(CheckpointError, match=want):
        load_checkpoint(fp32, ckpt)


def test_plan_counts_the_formats_bytes(engines):
    eng = engines()
    shapes = unit_shapes(eng.split)
    host_params = sum(s.numel for s in shapes)
    est = {}
    for master, moments in (("fp32", "fp32"), ("fp32", "bf16"), ("fp32", "8bit"), ("bf16", "8bit")):
        rt = RuntimeConfig(mode="slide", dtype="fp32", device="cpu", moments=moments, master=master)
        plan = PlacementPlan.build(shapes, rt)
        fmt = optimizer_state(master, moments)
        assert plan.host_state is fmt and plan.state_bytes()["host"] == fmt.bytes_per_param * host_params
        est[master, moments] = estimate_memory(eng.split, rt, batch_size=2, seq_len=16).host_bytes
    fp32 = est["fp32", "fp32"]
    assert fp32 - est["fp32", "bf16"] == 4 * host_params
    assert fp32 - est["fp32", "8bit"] == pytest.approx((8 - optimizer_state("fp32", "8bit").moment_bytes) * host_params)
    assert fp32 - est["bf16", "8bit"] == pytest.approx((12 - optimizer_state("bf16", "8bit").bytes_per_param)
                                                        * host_params, abs=1)


def test_what_it_does_not_run_is_refused_and_the_tiers_take_the_format(engines, tmp_path):
    """Refused before anything is built: the formats outside slide mode, with torch's host AdamW,
    and with the clipped sweep's weights pass (FP32 kernels). The disk tier and the ranks' shared
    state keep the format themselves (tests below), so their plans carry it."""
    with pytest.raises(ValueError, match="--moments 8bit .* needs --mode slide"):
        RuntimeConfig(mode="gpu", moments="8bit")
    with pytest.raises(ValueError, match="--master bf16 --moments 8bit keeps .* needs --mode slide"):
        RuntimeConfig(mode="ckpt", master="bf16", moments="8bit")
    with pytest.raises(ValueError, match="--tuning.host_adamw dynamic or static"):
        RuntimeConfig(moments="bf16", host_adamw="torch")
    eng = engines()
    shapes = unit_shapes(eng.split)
    with pytest.raises(ValueError, match="clip_sweep split"):
        PlacementPlan.build(shapes, RuntimeConfig(moments="bf16", dtype="bf16", clip_sweep="weights"),
                            schedule="deferred")
    fmt = optimizer_state("bf16", "8bit")
    two_ranks = PlacementPlan.build(shapes, RuntimeConfig(master="bf16", moments="8bit", dtype="fp32"), ranks=2)
    on_disk = PlacementPlan.build(shapes, RuntimeConfig(master="bf16", moments="8bit", dtype="fp32",
                                                        disk_dir=str(tmp_path), disk_units=2, disk_master="on"))
    assert two_ranks.host_state is fmt and on_disk.host_state is fmt
    n_disk = on_disk.params("disk")
    assert n_disk and on_disk.state_bytes()["disk"] == int(fmt.bytes_per_param * n_disk)
    assert on_disk.disk_io_bytes() == int(2 * fmt.bytes_per_param * n_disk)


# small blocks (1024 elements: several a tiny layer, and four 8-bit scales in each)
DISK_SMALL = dict(disk_block_mb=0.001, disk_buffers=3)


@pytest.mark.parametrize("where", ["moments", "master"])
@pytest.mark.parametrize("master, moments", FORMATS)
def test_the_disk_tier_keeps_the_format_bit_exact_against_ram(tmp_path, engines, master, moments, where):
    """Disk units in a compact format (their moments and 8-bit scales, "master": with
    --tuning.disk_master on their master too, in its dtype) train as the same format in RAM in every
    bit, clipped with accumulation; the files hold the format (tier_bytes: the plan's figure), and
    a checkpoint read through the tier resumes into RAM exactly."""
    fmt = optimizer_state(master, moments)
    kw = dict(grad_accum=2, max_grad_norm=0.5, layers=4)
    flags = dict(moments=moments, master=master)
    ram = engines(**kw, runtime=flags)
    disk = engines(**kw, runtime=dict(flags, **DISK_SMALL, disk_units=2, disk_dir=str(tmp_path),
                                      disk_master="on" if where == "master" else "off"))
    tier = disk.disk
    assert tier.state is fmt and tier.block == 1024 and len(tier.units) == 2
    assert all(tier.blocks(i) > 1 for i in tier.units)
    assert (set(tier.masters) == set(tier.units)) == (where == "master")
    files = sum(f.stat().st_size for f in tier.dir.glob("unit-*"))
    from slidetune.engine.slide.disk_tier import tier_bytes
    assert files == tier_bytes(disk.plan, DISK_SMALL["disk_block_mb"])
    assert train(ram, range(3), 2) == train(disk, range(3), 2)
    a, b = _state(ram), _state(disk)
    _identical(a, b)
    assert b["layer.3.exp_avg"].dtype == fmt.moment_dtype and ("layer.3.exp_avg_scales" in b) == (moments == "8bit")
    report = disk.memory_report()
    assert report["disk_read"] > 0 and report["disk_written"] > 0
    assert report["disk_state"] == disk.plan.state_bytes()["disk"] == pytest.approx(
        (fmt.bytes_per_param if where == "master" else fmt.moment_bytes) * disk.plan.params("disk"), abs=1)
    ckpt = save_checkpoint(disk, checkpoint_dir(tmp_path / "run", 3), step=3, trainer_state={})
    back = engines(**kw, runtime=flags, seed=99)
    load_checkpoint(back, ckpt)
    _identical(_state(back), b)
    assert train(back, range(3, 5), 2) == train(ram, range(3, 5), 2)


def test_an_8bit_chunk_starts_on_a_block():
    rt = RuntimeConfig()
    assert rt.transfer.chunk_elems(1000) == 1000 and rt.transfer.chunk_elems(1000, align=256) == 768
    assert rt.transfer.chunk_elems(100, align=256) == 256
    assert rt.transfer.chunk_elems(10**9, align=256) % 256 == 0


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--moments", "8bit"], ["--master", "bf16", "--moments", "8bit"]],
                         ids=["moments-8bit", "master-bf16-moments-8bit"])
def test_train_flag_runs_stops_and_resumes_bit_exact(tmp_path, flags):
    """`slidetune train` with the flags: the run records them (config.json, each checkpoint's
    state.json), a run stopped after step 3 resumes with `--resume auto` to the uninterrupted run's
    end-of-run checkpoint in every bit, and the same directory resumed with the FP32 state is
    refused naming the format it was saved with."""
    given = dict(zip(flags[::2], flags[1::2]))
    run = ["--max-steps", "4", "--save-every", "1", "--keep-last", "3", *flags]
    ref, stopped = tmp_path / "ref", tmp_path / "stopped"
    for d, extra in ((ref, []), (stopped, ["--stop-after", "3"])):
        code, out, err = run_cli(*COMMON, *run, "--output-dir", str(d), *extra)
        assert code == 0, err[-3000:]
    runtime = json.loads((ref / "config.json").read_text())["runtime"]
    state = json.loads((stopped / "checkpoints" / "checkpoint-3" / "trainer_state" / "state.json").read_text())
    for flag, value in given.items():
        assert runtime[flag[2:]] == value and state[flag[2:]] == value
    fp32 = [a if a not in ("8bit", "bf16") else "fp32" for a in run]
    code, out, err = run_cli(*COMMON, *fp32, "--resume", "auto", "--output-dir", str(stopped))
    assert code != 0 and "saved with" in err and "--moments 8bit" in err, err[-3000:]
    code, out, err = run_cli(*COMMON, *run, "--resume", "auto", "--output-dir", str(stopped))
    assert code == 0 and "resumed from" in out, err[-3000:]
    assert_bit_exact(stopped, ref)


def test_the_floor_counts_the_formats_traffic(engines):
    """bench.roofline: the host AdamW probe runs the format's kernel and records it; the host DRAM
    bytes of a clipped step's sweep are the format's two passes (8-bit: 12.03 + 6.06 B/param
    against FP32's 18 + 18)."""
    from slidetune.bench.floor_probes import ADAMW_BYTES, adamw_bytes, probe_adamw
    from slidetune.bench.roofline import adamw_dram_bytes, best_dram_gib_s
    eng = engines()
    shapes = unit_shapes(eng.split)
    fmt = optimizer_state("fp32", "8bit")
    probe = probe_adamw(n=1 << 16, steps=3, moments="8bit")
    assert probe["moments"] == "8bit" and probe["adamw_weights_pass_params_per_s"] > 0
    assert probe_adamw(n=1 << 16, steps=1, moments="8bit", master="bf16")["master"] == "bf16"
    assert "adamw_weights_copy_pass_params_per_s" not in probe         # no clip_sweep=weights with it
    assert best_dram_gib_s(probe) >= probe["adamw_bf16_grad_params_per_s"] * fmt.update_bytes(2) / 2**30
    for moments, state in (("fp32", FP32_ADAMW), ("8bit", fmt)):
        plan = PlacementPlan.build(shapes, RuntimeConfig(dtype="fp32", moments=moments), schedule="deferred")
        n = plan.host_updated_params
        got = adamw_dram_bytes(plan, {"grad_dtype": "bf16", "adamw_moments_pass_params_per_s": 1.0})
        assert got == pytest.approx((state.update_bytes(2, "params") + state.update_bytes(2, "moments")) * n)
    assert adamw_bytes(FP32_ADAMW) == ADAMW_BYTES


def test_plan_offers_compact_moments_where_host_ram_binds():
    """The issue's desktop: Llama-3.1-8B b8 x 2048, clip 1.0, a 24 GiB GPU and 64 GiB of RAM. FP32
    state is refused (host RAM); the options name --moments 8bit as an opt-in change, and with it
    the plan fits."""
    import contextlib
    import io

    from slidetune.cli import main

    def plan(*extra: str) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            main(["plan", "--model", "llama-3.1-8b", "--batch-size", "8", "--seq-len", "2048", "--device", "cuda",
                  "--gpu-free-gib", "24", "--host-gib", "64", "--no-limits", *extra])
        return out.getvalue()
    refused = plan()
    assert "does not fit" in refused and "host RAM too small" in refused
    assert "--moments 8bit  -> GPU" in refused and "opt-in: AdamW's moments in 8bit" in refused
    fits = plan("--moments", "8bit")
    assert "does not fit" not in fits and "moments 8bit" in fits
    # a compact state that does not fit is offered the next one (b16: the held gradients' 15 GiB
    # besides 8-bit moments; a BF16 master frees 15 GiB more)
    more = plan("--moments", "8bit", "--batch-size", "16")
    assert "does not fit" in more and "--master bf16  -> GPU" in more and "opt-in: the master in bf16" in more
    # a compact state that still does not fit is refused with the numbers, the disk tier offered
    # beside it (in the same format)
    short = plan("--master", "bf16", "--batch-size", "16")
    assert "does not fit" in short and "host RAM too small" in short
    assert "ValueError" not in short and "--disk-dir PATH" in short


def test_save_plan_counts_the_formats_checkpoint(engines, tmp_path):
    """A resumable checkpoint of an 8-bit run holds FP32 weights and 8-bit moments with their
    scales: the save plan asks for that room, not the FP32 state's 12 B/param (a desktop's disk
    would refuse checkpoints that fit)."""
    from slidetune.checkpoint.space import FILES_MARGIN, plan_saves
    eng = engines()
    shapes = unit_shapes(eng.split)
    n = sum(s.numel for s in shapes)
    fp32 = PlacementPlan.build(shapes, RuntimeConfig(dtype="fp32"))
    q8 = PlacementPlan.build(shapes, RuntimeConfig(dtype="fp32", moments="8bit"))
    assert fp32.checkpoint_bytes() == 12 * n
    assert q8.checkpoint_bytes() == 4 * n + sum(2 * optimizer_state("fp32", "8bit").moment_nbytes(s.numel)
                                                for s in shapes)
    kw = dict(save_dtype="bf16", output_dir=tmp_path, checkpoint_dir=tmp_path, save_every=1, keep_last=1,
              output_free=10**12, same_disk=True)
    assert plan_saves(n, **kw, checkpoint_bytes=q8.checkpoint_bytes()).checkpoint_bytes == q8.checkpoint_bytes() + FILES_MARGIN
    assert plan_saves(n, **kw).checkpoint_bytes == 12 * n + FILES_MARGIN
