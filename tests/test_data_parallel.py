"""Data-parallel slide (engine/distributed.py, docs/data_parallel.md) on CPU: 2 gloo ranks.

Two ranks at batch b follow one rank at batch 2b (fp32, relative 1e-5: only the order of the
gradient sums differs), with clipping that clips and with accumulation; the host state is one
shared mapping, counted once; a checkpoint written at 2 ranks resumes at 1 and one written at 1
resumes at 2. The ranks are spawned once for the whole module (a process start with torch and
transformers costs seconds here); each test reads its part of what they recorded.
"""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from slidetune.checkpoint import load_checkpoint, save_checkpoint
from slidetune.data import Batch
from slidetune.engine import AdamWConfig, RuntimeConfig, blockwise8, build_engine
from slidetune.engine.distributed import DataParallel, DistConfig, close_process_group, shard_units
from slidetune.engine.slide.disk_tier import StreamedTensor
from test_equivalence import FAMILIES, LR, make_batches, make_loaded

WORLD = 2
# the disk tier's directory: every process of the test (the spawned ranks import this module
# again) takes it from the environment the fixture sets
DISK_DIR = "$SLIDETUNE_TEST_DISK_DIR"
STEPS = 3
CKPT_STEP = 2          # the checkpoint is written after this many steps
CLIP = 0.05            # below every step's gradient norm here: the clipped path runs (asserted)
# name -> (model family, schedule, accumulation, max_grad_norm, extra runtime options)
RUNS = {
    # the recipe: clipping (deferred sweep) with accumulation; a resident layer and a 2-slot window
    # (dp_weights=upload: every rank uploads every host unit; the default, gather, runs below)
    "deferred-accum2-clip": ("llama", "deferred", 2, CLIP, {"cache_units": 2, "resident_layers": 1,
                                                            "dp_weights": "upload"}),
    # eager updates as each unit's gradient lands, tied embedding (the head's share reduced with
    # it), checkpoints offloaded (per rank: nothing shared)
    "eager-tied-offload": ("qwen3-tied-qknorm", "eager", 1, None, {"offload_activations": True, "cache_units": 2,
                                                                   "dp_weights": "upload"}),
    # units updated on the device (the vocabulary and a layer): every rank updates its own copy
    # from the all-reduced gradient, clipped, with accumulation; the rest shared and sharded
    "deferred-device-units": ("llama", "deferred", 2, CLIP, {"vocab_update": "device", "device_layers": 1,
                                                              "cache_units": 2}),
    "eager-device-layer": ("qwen3-tied-qknorm", "eager", 1, None, {"device_layers": 1, "cache_units": 2}),
    # the disk tier's units (head and top layer) on local rank 0, moments in its files; the
    # checkpoint-less run's optimizer state is read back through rank 0's tier
    "deferred-disk": ("llama", "deferred", 2, CLIP, {"disk_units": 2, "disk_dir": DISK_DIR, "disk_block_mb": 0.0625,
                                                     "cache_units": 2}),
    # dp_weights=gather: each host unit's owner uploads it and broadcasts it to the other rank
    # (with resident layers, a window, the vocabulary on the device, and the disk tier)
    "deferred-gather": ("llama", "deferred", 2, CLIP, {"dp_weights": "gather", "held_buffers": 2, "cache_units": 2,
                                                       "resident_layers": 1,
                                                       "disk_units": 1, "disk_dir": DISK_DIR,
                                                       "disk_block_mb": 0.0625}),
    "eager-gather": ("qwen3-tied-qknorm", "eager", 1, None, {"dp_weights": "gather", "cache_units": 2,
                                                             "vocab_update": "device", "offload_activations": True}),
    "eager-disk": ("llama", "eager", 1, None, {"disk_units": 2, "disk_dir": DISK_DIR, "disk_block_mb": 0.0625,
                                               "cache_units": 2}),
    # compact state (issue 46) in the shared mapping and the disk tier: 8-bit moments with their
    # scales and a BF16 master, clipped with accumulation; BF16 moments, eager
    "deferred-compact": ("llama", "deferred", 2, CLIP, {"moments": "8bit", "master": "bf16", "disk_units": 1,
                                                        "disk_dir": DISK_DIR, "disk_block_mb": 0.001,
                                                        "cache_units": 2}),
    "eager-bf16-moments": ("qwen3-tied-qknorm", "eager", 1, None, {"moments": "bf16", "cache_units": 2}),
    # sharded layers (shard_layers): two layers each on one rank's GPU (the lower rank 0's),
    # updated there and broadcast to the other through its window; clipped with accumulation,
    # beside a device layer and a resident host layer; and eager with the vocabulary on the device
    # (one rank: the same layers are device layers, the reference)
    "deferred-shard": ("llama", "deferred", 2, CLIP, {"device_layers": 1, "shard_layers": 2, "cache_units": 2,
                                                      "resident_layers": 1}),
    "eager-shard": ("qwen3-tied-qknorm", "eager", 1, None, {"shard_layers": 2, "cache_units": 2,
                                                            "vocab_update": "device"}),
}
# the masters' and moments' tolerance of the compact runs: rounding to a BF16 master or moment, or
# to an 8-bit code, turns the ranks' 1e-7 differences in the order of the gradient sums into a whole
# ulp or code in the few elements where they flip it (the losses and norms still agree to 1e-5)
STATE_RTOL = {"deferred-compact": 1e-3, "eager-bf16-moments": 1e-3}
# the runs rank 0 checkpoints after their last step (the disk units' moments read from its tier)
SAVED_AT_END = {"deferred-disk": "ckpt-disk-2ranks", "deferred-compact": "ckpt-compact-2ranks"}
RESUMED = "deferred-accum2-clip"
SHARDED = "deferred-shard"          # also checkpointed at 2 ranks, and resumed at 2 from 1


def runtime(schedule: str, extra: dict) -> RuntimeConfig:
    if extra.get("disk_dir") == DISK_DIR:
        extra = {**extra, "disk_dir": os.environ["SLIDETUNE_TEST_DISK_DIR"]}
    return RuntimeConfig(mode="slide", dtype="fp32", device="cpu", schedule=schedule, head_chunk_tokens=16,
                         chunk_mb=1, **{"offload_activations": False, **extra})


def engine_for(run: str, dist=None):
    fam, schedule, accum, clip, extra = RUNS[run]
    return build_engine(make_loaded(**FAMILIES[fam]), runtime(schedule, extra),
                        AdamWConfig(lr=LR, weight_decay=0.1, eps=1e-6), grad_accum=accum, max_grad_norm=clip,
                        dist=dist)


def step_batches(run: str, step: int, rank: int = 0, world: int = 1) -> list[Batch]:
    """The step's micro-batches of the whole batch (2 rows per rank), rows [2 rank, 2 rank + 2)
    of each for `rank`. Row 0 has a masked prompt: the ranks' token counts differ."""
    accum = RUNS[run][2]
    mbs = make_batches(step, accum, batch=2 * WORLD)
    rows = slice(rank * 2 * WORLD // world, (rank + 1) * 2 * WORLD // world)
    return [Batch(mb.input_ids[rows], mb.labels[rows], None) for mb in mbs]


def train(engine, run: str, steps: range, rank: int = 0, world: int = 1) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for step in steps:
        res = engine.train_step(step_batches(run, step, rank, world), LR * (0.5 + step))
        losses.append(res.loss)
        norms.append(res.grad_norm())
    engine.synchronize()
    return losses, norms


def masters(engine) -> dict[str, torch.Tensor]:
    """Every master this engine holds (not a sharded layer another rank keeps on its GPU)."""
    return {name: t.clone() for name, t in engine.named_master_params() if not isinstance(t, StreamedTensor)}


def optimizer_state(engine) -> dict[str, torch.Tensor]:
    """Every AdamW tensor this engine can read (a disk unit's moments streamed from its tier);
    without the disk units' moments on a rank that does not keep the tier (they are rank 0's), and
    without the sharded layers other ranks keep (rank 0 reads them only while they serve a save)."""
    out = {}
    remote = {u.spec.name for u in engine.units if u.remote}
    for k, t in engine.optimizer_tensors().items():
        if k.rsplit(".", 1)[0] in remote:
            continue
        if isinstance(t, StreamedTensor):
            try:
                t = torch.cat(list(t.chunks()))
            except RuntimeError as e:
                assert "local rank 0's disk tier" in str(e) or "'s GPU; only that rank reads it" in str(e)
                continue
        out[k] = t.clone()
    return _as_fp32(out)


def _as_fp32(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A compact format's moments as FP32 values to compare (8-bit: dequantized with their scales,
    which leave the dict), every other tensor as it is."""
    out = {}
    for k, t in state.items():
        if k.endswith("_scales"):
            continue
        if t.dtype == blockwise8.CODE_DTYPE:
            t = blockwise8.dequantize(t, state[f"{k}_scales"], k.rsplit(".", 1)[1])
        out[k] = t.float()
    return out


# ---------------------------------------------------------------------------- the ranks
def _rank_main(rank: int, port: int, out: str, ckpt_1rank: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dp = DataParallel(DistConfig.from_env(backend="gloo", timeout_s=300))
    record: dict = {}
    try:
        for run in RUNS:
            engine = engine_for(run, dp)
            gathers: list[tuple[int, int]] = []        # dp_weights=gather: (unit, version) as broadcast
            if engine.gather:
                broadcast = engine.slots._gather

                def logged(unit_index, slot, *a, broadcast=broadcast, gathers=gathers):
                    gathers.append((unit_index, slot.content[1]))
                    return broadcast(unit_index, slot, *a)
                engine.slots._gather = logged
            try:
                if run == RESUMED:
                    losses, norms = train(engine, run, range(CKPT_STEP), rank, WORLD)
                    if rank == 0:                  # written once, from the shared state
                        save_checkpoint(engine, os.path.join(out, "ckpt-2ranks"), step=CKPT_STEP)
                    dp.barrier()
                    more = train(engine, run, range(CKPT_STEP, STEPS), rank, WORLD)
                    losses, norms = losses + more[0], norms + more[1]
                else:
                    losses, norms = train(engine, run, range(STEPS), rank, WORLD)
                if run in SAVED_AT_END:
                    if rank == 0:                  # the disk units' moments come from rank 0's tier
                        save_checkpoint(engine, os.path.join(out, SAVED_AT_END[run]), step=STEPS)
                    dp.barrier()
                if run == SHARDED:
                    # rank 0 writes; the sharded layer rank 1 keeps on its GPU comes from it (it serves)
                    _save_serving(engine, rank, os.path.join(out, "ckpt-shard-2ranks"))
                record[run] = {"losses": losses, "norms": norms, "masters": masters(engine),
                               "optimizer": optimizer_state(engine),
                               "on_device": [i for i, u in enumerate(engine.units) if u.on_device],
                               "owned": [i for i, u in enumerate(engine.units) if u.owned],
                               "remote": [i for i, u in enumerate(engine.units) if u.remote],
                               "sharded": engine.plan.indices("shard"),
                               "disk": sorted(engine.disk.units) if engine.disk is not None else [],
                               "uploaded": engine.uploader.bytes, "gathers": gathers}
                if run == RESUMED:
                    record["sharing"] = _sharing_probe(engine, dp, rank)
            finally:
                engine.close()
        # a checkpoint written by one rank, resumed at two
        engine = engine_for(RESUMED, dp)
        try:
            load_checkpoint(engine, ckpt_1rank)
            loaded = masters(engine)
            losses, norms = train(engine, RESUMED, range(CKPT_STEP, STEPS), rank, WORLD)
            record["resumed-from-1rank"] = {"loaded": loaded, "losses": losses, "norms": norms,
                                            "masters": masters(engine)}
        finally:
            engine.close()
        # a checkpoint with the sharded layers written by one rank (as device layers), resumed at two
        engine = engine_for(SHARDED, dp)
        try:
            load_checkpoint(engine, os.path.join(out, "ckpt-shard-1rank"))
            losses, norms = train(engine, SHARDED, range(CKPT_STEP, STEPS), rank, WORLD)
            record["shard-resumed-from-1rank"] = {"losses": losses, "norms": norms, "masters": masters(engine),
                                                  "optimizer": optimizer_state(engine),
                                                  "owned": [i for i, u in enumerate(engine.units) if u.owned],
                                                  "remote": [i for i, u in enumerate(engine.units) if u.remote]}
        finally:
            engine.close()
        torch.save(record, os.path.join(out, f"rank{rank}.pt"))
    finally:
        close_process_group()


def _save_serving(engine, rank: int, path: str) -> None:
    """A checkpoint of an engine with sharded layers at 2 ranks, as the trainer writes it
    (Ranks.on_main with the engine's save_service): rank 0 writes, the other serves its GPU state."""
    service = engine.save_service
    assert service is not None and service.serving == {1}
    if rank == 0:
        try:
            save_checkpoint(engine, path, step=STEPS)
        finally:
            service.end()
    else:
        service.serve()


def _host_main(rank: int, port: int, out: str) -> None:
    """One rank per emulated host (LOCAL_WORLD_SIZE=1): each has a state copy of its own and
    updates every unit; only the gradient reduction crosses the "hosts"."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    torch.set_num_threads(1)
    dp = DataParallel(DistConfig.from_env(backend="gloo", timeout_s=300))
    try:
        engine = engine_for(RESUMED, dp)
        try:
            losses, norms = train(engine, RESUMED, range(STEPS), rank, WORLD)
            torch.save({"losses": losses, "norms": norms, "masters": masters(engine),
                        "owned": all(u.owned for u in engine.units), "shared_bytes": engine.shared.nbytes},
                       os.path.join(out, f"host{rank}.pt"))
        finally:
            engine.close()
    finally:
        close_process_group()


def _sharing_probe(engine, dp: DataParallel, rank: int) -> dict:
    """What shows the host state is one mapping: each rank's units are views of one storage of the
    shared state's size, and a value one rank writes into a unit it does not own is what the owner
    reads. Runs after the run's masters were recorded (the write spoils them)."""
    storages = {u.master.untyped_storage().data_ptr() for u in engine.units}
    storage_bytes = engine.units[0].master.untyped_storage().nbytes()
    foreign = next(i for i, u in enumerate(engine.units) if not u.owned)
    mine = next(i for i, u in enumerate(engine.units) if u.owned)
    dp.barrier()
    sentinel = 1234.5 + rank
    engine.units[foreign].master[0] = sentinel      # into the other rank's unit
    dp.barrier()
    seen = float(engine.units[mine].master[0])      # what the other rank wrote into mine
    dp.barrier()
    return {"storages": len(storages), "storage_bytes": storage_bytes, "shared_bytes": engine.shared.nbytes,
            "seen": seen, "other_sentinel": 1234.5 + (1 - rank),
            "host_state": engine.memory_report()["host_state"],
            "owned_params": sum(u.spec.numel for u in engine.units if u.owned)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- one rank, then two
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp")
    os.environ["SLIDETUNE_TEST_DISK_DIR"] = str(tmp_path_factory.mktemp("disk"))
    torch.manual_seed(0)
    one: dict = {}
    for run in RUNS:
        engine = engine_for(run)
        one["unit_names"] = [u.spec.name for u in engine.units]
        try:
            if run == SHARDED:
                # checkpointed at one rank (its sharded layers are device layers there) to resume at two
                losses, norms = train(engine, run, range(CKPT_STEP))
                save_checkpoint(engine, tmp / "ckpt-shard-1rank", step=CKPT_STEP)
                more = train(engine, run, range(CKPT_STEP, STEPS))
                losses, norms = losses + more[0], norms + more[1]
            elif run == RESUMED:
                # the run is checkpointed and resumed at one rank too (exact: test_checkpoint.py)
                losses, norms = train(engine, run, range(CKPT_STEP))
                save_checkpoint(engine, tmp / "ckpt-1rank", step=CKPT_STEP)
                engine.close()
                engine = engine_for(run)
                load_checkpoint(engine, tmp / "ckpt-1rank")
                one["host_state"] = engine.memory_report()["host_state"]
                one["params"] = sum(u.spec.numel for u in engine.units)
                one["units"] = len(engine.units)
                more = train(engine, run, range(CKPT_STEP, STEPS))
                losses, norms = losses + more[0], norms + more[1]
            else:
                losses, norms = train(engine, run, range(STEPS))
            one[run] = {"losses": losses, "norms": norms, "masters": masters(engine),
                        "optimizer": optimizer_state(engine), "uploaded": engine.uploader.bytes,
                        "embed_upload_bytes": engine.units[0].spec.numel * 4}      # FP32 on the CPU
        finally:
            engine.close()
    mp.spawn(_rank_main, args=(_free_port(), str(tmp), str(tmp / "ckpt-1rank")), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return {"one": one, "ranks": ranks, "tmp": tmp}


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * abs(b)


def _worst_rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert got.keys() == want.keys()
    return max((float((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-30)), k) for k in want)


def _with_sharded_layers(results, run: str, rank: int) -> dict:
    """A rank's record of a run, its masters and optimizer state completed from their owners with
    the sharded layers other ranks keep on their GPUs (of which this rank holds nothing: checked)."""
    rec = dict(results["ranks"][rank][run])
    names = results["one"]["unit_names"]
    remote = {names[i] for i in rec["remote"]}
    for key in ("masters", "optimizer"):
        held = dict(rec[key])
        assert not [k for k in held if _unit_of(k) in remote], (rank, key)
        for other in results["ranks"]:
            held.update({k: v for k, v in other[run][key].items() if _unit_of(k) in remote})
        rec[key] = held
    return rec


def _unit_of(key: str) -> str | None:
    """The decoder layer unit ("layer.1") of an HF parameter name or an optimizer key; None otherwise."""
    parts = key.split(".")
    if key.startswith("model.layers."):
        return f"layer.{parts[2]}"
    if key.startswith("layer."):
        return f"layer.{parts[1]}"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_two_ranks_follow_one_rank_at_twice_the_batch(results, run):
    want = results["one"][run]
    engine_units = results["one"]["unit_names"]
    for rank, rec in enumerate(results["ranks"]):
        got = _with_sharded_layers(results, run, rank)
        for step in range(STEPS):
            assert _close(got["losses"][step], want["losses"][step]), (rank, step, got["losses"], want["losses"])
            assert _close(got["norms"][step], want["norms"][step]), (rank, step, got["norms"], want["norms"])
        rtol = STATE_RTOL.get(run, 1e-5)
        worst, where = _worst_rel(got["masters"], want["masters"])
        assert worst < rtol, f"rank {rank} {where}: relative difference {worst:.2e}"
        optimizer = want["optimizer"]
        if RUNS[run][4].get("disk_units") and rank:
            # the disk units' moments are in local rank 0's tier alone
            disk_units = {engine_units[i] for i in results["ranks"][0][run]["disk"]}
            names = {k for k in optimizer if k.rsplit(".", 1)[0] in disk_units and not k.endswith(".step")}
            assert set(optimizer) - set(got["optimizer"]) == names
            optimizer = {k: v for k, v in optimizer.items() if k not in names}
        worst, where = _worst_rel(got["optimizer"], optimizer)
        assert worst < rtol, f"rank {rank} optimizer {where}: relative difference {worst:.2e}"
    extra = RUNS[run][4]
    uploaded = [rec[run]["uploaded"] for rec in results["ranks"]]
    if extra.get("dp_weights", RuntimeConfig().transfer.dp_weights) == "gather":      # (gather: the default)
        # broadcast in the order they are needed: a step's own weights before the next step's, and
        # the next step's from the embedding up (the gather thread runs them in queue order)
        for rec in results["ranks"]:
            seq = rec[run]["gathers"]
            assert seq == results["ranks"][0][run]["gathers"]          # the same collectives on every rank
            versions = [v for _, v in seq]
            # (the last step registers the weights of a step that never runs: version STEPS)
            assert versions == sorted(versions) and set(range(STEPS)) <= set(versions) <= set(range(STEPS + 1)), seq
            for v in set(versions) - {0}:
                units = [u for u, w in seq if w == v]
                assert units[0] == min(units), (v, units)       # the next step's from the embedding up
        # each host unit crossed a host link once, from its owner: the ranks' uploads together are
        # one rank's (clipped with the embedding on the host: and its next-step weights after the
        # last step, registered in order ahead of the resident layers'), and neither rank
        # uploaded everything
        tail = want["embed_upload_bytes"] if RUNS[run][1] == "deferred" and not extra.get("vocab_update") else 0
        assert sum(uploaded) == want["uploaded"] + tail and all(0 < u < want["uploaded"] for u in uploaded), \
            (uploaded, want["uploaded"], tail)
    elif run != RESUMED:      # (the reference of the resumed run restarted: its first uploads twice)
        assert all(u == want["uploaded"] for u in uploaded), (uploaded, want["uploaded"])
    if extra.get("disk_units"):
        disk = [rec[run]["disk"] for rec in results["ranks"]]
        assert len(disk[0]) == extra["disk_units"] and disk[1:] == [[]] * (WORLD - 1), disk
        assert set(disk[0]) <= set(results["ranks"][0][run]["owned"])
        assert not set(disk[0]) & set(results["ranks"][1][run]["owned"])
    sharded = results["ranks"][0][run]["sharded"]
    if sharded:
        # each sharded layer on one rank's GPU, round robin from the lowest; the other holds nothing of it
        for rank, rec in enumerate(results["ranks"]):
            mine = {u for k, u in enumerate(sharded) if k % WORLD == rank}
            assert set(rec[run]["on_device"]) & set(sharded) == mine and set(rec[run]["remote"]) == set(sharded) - mine
    if extra.get("device_layers") or extra.get("vocab_update") == "device":
        on_device = [u for u in results["ranks"][0][run]["on_device"] if u not in sharded]
        assert on_device and all([u for u in rec[run]["on_device"] if u not in sharded] == on_device
                                 for rec in results["ranks"])
        # every rank updates its own copy of each device unit; the host units have one owner
        for rec in results["ranks"]:
            assert set(on_device) <= set(rec[run]["owned"])
        host_owned = [set(rec[run]["owned"]) - set(on_device) for rec in results["ranks"]]
        assert all(host_owned) and not host_owned[0] & host_owned[1]
    if RUNS[run][3] is not None:
        assert min(want["norms"]) > RUNS[run][3], "the clip threshold must clip every step"
    # the weights moved: a no-op engine on both sides would pass the comparisons above
    start = masters(engine_for(run))
    assert _worst_rel(want["masters"], start)[0] > 1e-3


@pytest.mark.slow
def test_ranks_share_one_host_state(results):
    probes = [rec["sharing"] for rec in results["ranks"]]
    one = results["one"]
    for rank, p in enumerate(probes):
        assert p["storages"] == 1, "every unit's master must be a view of the one shared mapping"
        assert p["storage_bytes"] == p["shared_bytes"]
        assert p["seen"] == p["other_sentinel"], "a write by the other rank must be visible"
        assert p["owned_params"] > 0, f"rank {rank} owns no unit"
    # counted once: the ranks' host state together is the one-rank run's, plus the shared file's
    # alignment, steps and version counters (at most 64 B per tensor and 16 B per unit)
    total = sum(p["host_state"] for p in probes)
    assert one["host_state"] <= total <= one["host_state"] + one["units"] * (4 * 64 + 16) + 64
    # every unit has one owner
    assert sum(p["owned_params"] for p in probes) == one["params"]


@pytest.mark.slow
def test_checkpoint_written_at_two_ranks_resumes_at_one(results):
    tmp = results["tmp"]
    two = results["ranks"][0][RESUMED]
    engine = engine_for(RESUMED)
    try:
        load_checkpoint(engine, tmp / "ckpt-2ranks")
        losses, _ = train(engine, RESUMED, range(CKPT_STEP, STEPS))
        final = masters(engine)
    finally:
        engine.close()
    assert _close(losses[0], two["losses"][CKPT_STEP])
    worst, where = _worst_rel(final, two["masters"])
    assert worst < 1e-5, f"{where}: relative difference {worst:.2e}"
    worst, where = _worst_rel(final, results["one"][RESUMED]["masters"])
    assert worst < 1e-5, f"{where}: relative difference {worst:.2e}"


@pytest.mark.slow
def test_checkpoint_written_at_one_rank_resumes_at_two(results):
    one = results["one"][RESUMED]
    ckpt_engine = engine_for(RESUMED)
    try:
        load_checkpoint(ckpt_engine, results["tmp"] / "ckpt-1rank")
        saved = masters(ckpt_engine)
    finally:
        ckpt_engine.close()
    for rank, rec in enumerate(results["ranks"]):
        got = rec["resumed-from-1rank"]
        for name, t in saved.items():                  # loaded bit for bit
            assert torch.equal(got["loaded"][name], t), (rank, name)
        assert _close(got["losses"][0], one["losses"][CKPT_STEP])
        worst, where = _worst_rel(got["masters"], one["masters"])
        assert worst < 1e-5, f"rank {rank} {where}: relative difference {worst:.2e}"


@pytest.mark.slow
def test_checkpoint_with_sharded_layers_written_at_two_ranks_loads_at_one(results):
    """Rank 0 wrote it, reading the sharded layer rank 1 keeps on its GPU from rank 1 (it served the
    save): loaded at one rank (where those layers are device layers) it is the 2-rank run's state,
    and that is one rank's at twice the batch."""
    want = results["one"][SHARDED]
    engine = engine_for(SHARDED)
    try:
        load_checkpoint(engine, results["tmp"] / "ckpt-shard-2ranks")
        got_masters, got_optimizer = masters(engine), optimizer_state(engine)
    finally:
        engine.close()
    worst, where = _worst_rel(got_masters, want["masters"])
    assert worst < 1e-5, f"{where}: relative difference {worst:.2e}"
    worst, where = _worst_rel(got_optimizer, want["optimizer"])
    assert worst < 1e-5, f"optimizer {where}: relative difference {worst:.2e}"
    two = _with_sharded_layers(results, SHARDED, 0)
    for name, t in two["masters"].items():                 # every tensor as the ranks held it
        assert torch.equal(got_masters[name], t), name


@pytest.mark.slow
def test_checkpoint_written_at_one_rank_resumes_at_two_with_sharded_layers(results):
    """Each owner loads its sharded layers onto its GPU from a one-rank checkpoint; the resumed
    2-rank run ends where the one-rank run does."""
    want = results["one"][SHARDED]
    names = results["one"]["unit_names"]
    for rank, rec in enumerate(results["ranks"]):
        got = rec["shard-resumed-from-1rank"]
        assert got["remote"] and not set(got["remote"]) & set(got["owned"])
        for step, loss in enumerate(got["losses"]):
            assert _close(loss, want["losses"][CKPT_STEP + step]), (rank, got["losses"], want["losses"])
        merged = dict(got["masters"])
        for other in results["ranks"]:
            merged.update({k: v for k, v in other["shard-resumed-from-1rank"]["masters"].items()
                           if _unit_of(k) in {names[i] for i in got["remote"]}})
        worst, where = _worst_rel(merged, want["masters"])
        assert worst < 1e-5, f"rank {rank} {where}: relative difference {worst:.2e}"


@pytest.mark.slow
def test_two_hosts_each_with_its_own_state_copy(results):
    """Issue 21's across-hosts case, emulated by two processes that each are a host of one rank."""
    tmp = results["tmp"]
    mp.spawn(_host_main, args=(_free_port(), str(tmp)), nprocs=WORLD, join=True)
    want = results["one"][RESUMED]
    for rank in range(WORLD):
        got = torch.load(tmp / f"host{rank}.pt", weights_only=False)
        assert got["owned"], "a host of one rank updates every unit of its own copy"
        for step in range(STEPS):
            assert _close(got["losses"][step], want["losses"][step]), (rank, step)
            assert _close(got["norms"][step], want["norms"][step]), (rank, step)
        worst, where = _worst_rel(got["masters"], want["masters"])
        assert worst < 1e-5, f"host {rank} {where}: relative difference {worst:.2e}"


# ---------------------------------------------------------------------------- without processes
def test_shards_balance_parameters():
    # an embedding and a head of 5 layers each, 8 layers of 1: 9 and 9
    owners = shard_units([5] + [1] * 8 + [5], 2)
    loads = [sum(n for n, o in zip([5] + [1] * 8 + [5], owners) if o == r) for r in range(2)]
    assert loads == [9, 9]
    assert owners[0] != owners[-1]
    assert shard_units([3, 3, 3], 1) == [0, 0, 0]


def test_pinned_units_keep_their_owner_and_count_towards_its_load():
    # the disk tier's units (the head and the top layer here) on part 0; the rest balance around them
    numels = [5] + [1] * 8 + [5]
    owners = shard_units(numels, 2, pinned={9: 0, 8: 0})
    assert owners[9] == owners[8] == 0
    loads = [sum(n for n, o in zip(numels, owners) if o == r) for r in range(2)]
    assert abs(loads[0] - loads[1]) <= 1 and owners[0] == 1


def test_dist_config_from_torchrun_env(monkeypatch):
    for k, v in dict(WORLD_SIZE="4", RANK="3", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    cfg = DistConfig.from_env(backend="gloo")
    assert (cfg.world_size, cfg.rank, cfg.local_rank, cfg.host, cfg.num_hosts) == (4, 3, 1, 1, 2)
    with pytest.raises(ValueError, match="mod"):
        DistConfig(world_size=4, rank=3, local_rank=0, local_world_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("run", list(SAVED_AT_END))
def test_checkpoint_with_the_disk_tier_written_at_two_ranks_loads_at_one(results, run):
    """Rank 0 wrote the whole state, its tier's moments included (a compact format's in their
    dtypes, from the shared mapping and the tier); one rank with the same disk placement loads it
    and holds, in every bit, what rank 0 held when it wrote it."""
    engine = engine_for(run)
    try:
        assert engine.disk is not None and len(engine.disk.units) == RUNS[run][4]["disk_units"]
        load_checkpoint(engine, results["tmp"] / SAVED_AT_END[run])
        got_masters, got_optimizer = masters(engine), optimizer_state(engine)
    finally:
        engine.close()
    want = results["ranks"][0][run]
    for got, ref in ((got_masters, want["masters"]), (got_optimizer, want["optimizer"])):
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


# ---------------------------------------------------------------------------- shared memory
def test_shared_state_layout_size_is_what_the_mapping_takes(tmp_path):
    from slidetune.engine.distributed import SharedHostState
    numels, disk = [10, 20, 3], frozenset({1})
    state = SharedHostState(numels, str(tmp_path / "state"), create=True, no_moments=disk)
    assert state.nbytes == SharedHostState.layout_bytes(numels, disk) == (tmp_path / "state").stat().st_size
    assert state.units[1].exp_avg.numel() == 0 and state.units[1].master.numel() == 20
    # a compact format's dtypes, the 8-bit moments' scales beside them (a disk unit's moments empty)
    from slidetune.engine.adamw import optimizer_state
    fmt = optimizer_state("bf16", "8bit")
    numels = [300, 20, 3]
    compact = SharedHostState(numels, str(tmp_path / "compact"), create=True, no_moments=disk, state=fmt)
    assert compact.nbytes == SharedHostState.layout_bytes(numels, disk, fmt) == (tmp_path / "compact").stat().st_size
    unit = compact.units[0]
    assert unit.master.dtype == torch.bfloat16 and unit.exp_avg.dtype == torch.uint8 and unit.exp_avg.numel() == 300
    assert unit.exp_avg_scales.numel() == unit.exp_avg_sq_scales.numel() == 2 and unit.step.dim() == 0
    assert len(unit.optimizer_state()) == 5 and compact.units[1].exp_avg_scales.numel() == 0
    # 64-byte aligned pieces: master 600 -> 640, codes 300 -> 320 each, scales 8 -> 64 each, step 64
    assert SharedHostState.layout_bytes([300], state=fmt) == 640 + 2 * 320 + 2 * 64 + 64 + 64


def test_too_small_shared_memory_is_refused_naming_the_fix(tmp_path):
    import shutil as sh
    from slidetune.engine.distributed import SharedMemoryError, check_shared_memory
    free = sh.disk_usage(tmp_path).free
    with pytest.raises(SharedMemoryError, match=r"--shm-size .*remount,size="):
        check_shared_memory(free + 2**30, str(tmp_path))
    with pytest.raises(SharedMemoryError, match="does not exist"):
        check_shared_memory(1, str(tmp_path / "missing"))
    check_shared_memory(1, str(tmp_path))


def test_stale_shared_states_of_dead_runs_are_removed(tmp_path):
    import subprocess
    import sys
    from slidetune.engine.distributed import SHM_PREFIX, remove_stale_states
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for pid in (dead.pid, 1, os.getpid()):          # gone, alive, this process
        (tmp_path / f"{SHM_PREFIX}{pid}-abc").write_bytes(b"x")
    (tmp_path / "other-file").write_bytes(b"x")
    assert remove_stale_states(str(tmp_path)) == [f"{SHM_PREFIX}{dead.pid}-abc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["other-file", f"{SHM_PREFIX}1-abc", f"{SHM_PREFIX}{os.getpid()}-abc"])


def _shm_refusal_main(rank: int, port: int, out: str) -> None:
    """Both ranks of a host whose shared-memory directory is missing: each raises the same error."""
    import slidetune.engine.distributed as distributed
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    distributed.SHM_DIR = os.path.join(out, "no-shm")
    dp = DataParallel(DistConfig.from_env(backend="gloo", timeout_s=60))
    try:
        dp.share_host_state([16, 16])
        message = "no error"
    except distributed.SharedMemoryError as e:
        message = str(e)
    finally:
        close_process_group()
    with open(os.path.join(out, f"shm{rank}.txt"), "w") as f:
        f.write(message)


@pytest.mark.slow
def test_every_rank_gets_the_shared_memory_refusal(tmp_path):
    mp.spawn(_shm_refusal_main, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    messages = [(tmp_path / f"shm{r}.txt").read_text() for r in range(WORLD)]
    assert messages[0] == messages[1] and "does not exist" in messages[0] and "no-shm" in messages[0]


def _failed_pull_main(rank: int, port: int, out: str) -> None:
    """A save of an engine with sharded layers whose owner cannot read its layer: rank 0's save fails
    naming that rank, the checkpoint written before stays the latest, and rank 1 stops serving."""
    from slidetune.checkpoint import CheckpointError, latest_checkpoint
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dp = DataParallel(DistConfig.from_env(backend="gloo", timeout_s=120))
    outcome = "no error"
    try:
        engine = engine_for(SHARDED, dp)
        try:
            train(engine, SHARDED, range(1), rank, WORLD)
            _save_serving(engine, rank, os.path.join(out, "run", "checkpoint-1"))
            if rank == 1:
                def unreadable(*args):
                    raise OSError("an injected read failure")
                engine.save_service._read = unreadable
            try:
                _save_serving(engine, rank, os.path.join(out, "run", "checkpoint-2"))
            except CheckpointError as e:
                outcome = str(e)
            if rank == 0:
                outcome += f"\nlatest: {latest_checkpoint(os.path.join(out, 'run')).name}"
        finally:
            engine.close()
    finally:
        close_process_group()
    with open(os.path.join(out, f"pull{rank}.txt"), "w") as f:
        f.write(outcome)


@pytest.mark.slow
def test_a_sharded_layer_its_owner_cannot_read_fails_the_save_and_keeps_the_last(tmp_path):
    os.environ["SLIDETUNE_TEST_DISK_DIR"] = str(tmp_path)
    mp.spawn(_failed_pull_main, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    zero, one = ((tmp_path / f"pull{r}.txt").read_text() for r in range(WORLD))
    assert "local rank 1 could not read unit" in zero and "latest: checkpoint-1" in zero, zero
    assert one == "no error"           # rank 1 served until rank 0 ended the save, then went on
    assert not list((tmp_path / "run").glob("checkpoint-2*")), "no partial checkpoint is left"


def test_fit_check_refuses_a_shared_memory_too_small_before_anything_is_allocated(tmp_path, monkeypatch):
    import slidetune.engine.distributed as distributed
    from slidetune.engine.fit import check_fit, shared_state_bytes
    split = make_loaded("llama", tied=False).split
    rt = runtime("deferred", {"cache_units": 2})
    kw = dict(batch_size=2, seq_len=16, max_grad_norm=1.0, host_available_bytes=1 << 40)
    est = check_fit(split, rt, ranks_per_host=2, **kw)     # this machine's /dev/shm holds a tiny model
    engine = engine_for("deferred-accum2-clip")
    try:        # the size checked is the mapping's size for this placement (one rank: no mapping)
        numels = [u.numel if u.host_updated else 0 for u in est.plan.units]
        assert shared_state_bytes(est.plan) == distributed.SharedHostState.layout_bytes(numels)
        assert shared_state_bytes(est.plan) >= 12 * sum(u.spec.numel for u in engine.units)
    finally:
        engine.close()
    monkeypatch.setattr(distributed, "SHM_DIR", str(tmp_path / "no-shm"))
    with pytest.raises(distributed.SharedMemoryError, match="no-shm and needs .* but it does not exist"):
        check_fit(split, rt, ranks_per_host=2, **kw)
    check_fit(split, rt, ranks_per_host=1, **kw)           # one rank shares nothing
