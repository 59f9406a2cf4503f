"""Scheduling properties of the sliding pipeline (CPU: same code, streams are no-ops)."""
from __future__ import annotations

import inspect

import pytest
import torch

from slidetune.device import Device
from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
from slidetune.engine.slide import activations, engine, transfer
from test_equivalence import make_batches, make_loaded


def _engine(**rt):
    loaded = make_loaded("llama", tied=False, layers=6)
    return build_engine(loaded, RuntimeConfig(mode="slide", dtype="fp32", device="cpu", **rt), AdamWConfig(lr=1e-3))


def test_no_device_synchronize_on_the_hot_path(monkeypatch):
    calls = []
    monkeypatch.setattr(Device, "synchronize", lambda self: calls.append(1))
    eng = _engine()
    try:
        for step in range(2):
            eng.train_step(make_batches(step, 1), 1e-3)
        assert calls == []                 # only engine.synchronize() (save/eval) may call it
    finally:
        eng.close()
    for module in (engine, transfer, activations):
        assert "torch.cuda.synchronize" not in inspect.getsource(module)


def _spy_uploads(eng) -> list[tuple[str, int]]:
    uploads: list[tuple[str, int]] = []
    orig = eng.uploader.upload

    def spy(unit, dst, version, after):
        uploads.append((unit.spec.name, version))
        return orig(unit, dst, version, after)

    eng.uploader.upload = spy
    return uploads


@pytest.mark.parametrize("K", [2, 3, 4])
def test_layers_resident_at_the_turn_are_not_uploaded_again(K):
    """Per step: each layer up once for forward and once for backward, except the K
    still resident when the backward starts (all K slots: the planner evicts by next use);
    the embedding once for this step and, after its backward, once more with the next
    step's weights; the head once for this step and, mid-backward, once more with the next
    step's weights (it is updated first), so step 1 uploads neither again."""
    eng = _engine(cache_units=K)
    try:
        L = eng.split.num_layers
        uploads = _spy_uploads(eng)
        eng.train_step(make_batches(0, 1), 1e-3)
        eng.synchronize()
        layer_loads = [u for u, _ in uploads if u.startswith("layer.")]
        assert len(layer_loads) == 2 * L - K
        assert [u for u in uploads if u[0] == "embed"] == [("embed", 0), ("embed", 1)]
        assert [u for u in uploads if u[0] == "head"] == [("head", 0), ("head", 1)]
        # the backward re-uploads the layers in reverse order, after the forward's
        assert layer_loads[:L] == [f"layer.{i}" for i in range(L)]
        assert layer_loads[L:] == [f"layer.{i}" for i in reversed(range(L - K))]
        uploads.clear()
        eng.train_step(make_batches(1, 1), 1e-3)
        eng.synchronize()
        assert [u for u in uploads if u[0] == "head"] == [("head", 2)]
        assert [u for u in uploads if u[0] == "embed"] == [("embed", 2)]
    finally:
        eng.close()


def test_resident_layers_are_uploaded_once_per_step_after_their_update():
    """cache_units=0: one slot per layer; after the first forward every layer is uploaded
    exactly once per step, with the next step's weights, in the order the host begins the
    updates. Which order that is depends on timing (the host takes, among the units whose
    gradients are down, the one the next forward needs first), so it is recorded, not assumed."""
    eng = _engine(cache_units=0)
    try:
        L = eng.split.num_layers
        uploads = _spy_uploads(eng)
        begun: list[str] = []
        for unit in eng.units:
            orig = unit.begin_update
            unit.begin_update = lambda orig=orig, name=unit.spec.name: (begun.append(name), orig())[1]
        eng.train_step(make_batches(0, 1), 1e-3)
        eng.synchronize()
        layers = [u for u in uploads if u[0].startswith("layer.")]
        order = [n for n in begun if n.startswith("layer.")]
        assert sorted(order) == sorted(f"layer.{i}" for i in range(L))
        assert layers == [(f"layer.{i}", 0) for i in range(L)] + [(n, 1) for n in order]
        uploads.clear()
        begun.clear()
        eng.train_step(make_batches(1, 1), 1e-3)
        eng.synchronize()
        order = [n for n in begun if n.startswith("layer.")]
        assert sorted(order) == sorted(f"layer.{i}" for i in range(L))
        assert [u for u in uploads if u[0].startswith("layer.")] == [(n, 2) for n in order]
    finally:
        eng.close()


@pytest.mark.parametrize("clip", [None, 1.0])
def test_micro_batches_run_layer_by_layer_each_unit_uploaded_once(clip):
    """Accumulation runs the micro-batches layer by layer: every unit's weights for the step go up
    once, however many micro-batches (a 2-slot window over 4 layers: each layer once in the
    forward, once in the backward, except the two still there at the turn)."""
    loaded = make_loaded("qwen3", tied=True, layers=4)
    eng = build_engine(loaded, RuntimeConfig(mode="slide", dtype="fp32", device="cpu", cache_units=2),
                       AdamWConfig(lr=1e-3), grad_accum=3, max_grad_norm=clip)
    try:
        ups = []
        orig = eng.uploader.upload
        eng.uploader.upload = lambda unit, dst, version, *a: (ups.append((unit.spec.name, version)),
                                                              orig(unit, dst, version, *a))[1]
        eng.train_step(make_batches(0, 3), 1e-3)
        eng.synchronize()
        step0 = [n for n, v in ups if v == 0]
        assert step0.count("embed") == 1 and step0.count("head") == 1
        layers = [u.name for u in loaded.split.layer_units]
        assert [step0.count(n) for n in layers] == [2, 2, 1, 1]
    finally:
        eng.close()


def test_worker_failure_surfaces_instead_of_hanging():
    eng = _engine()
    try:
        def boom(*a, **k):
            raise RuntimeError("disk on fire")
        eng.drainer.consume = boom
        with pytest.raises(Exception, match="disk on fire"):
            eng.train_step(make_batches(0, 1), 1e-3)
            eng.train_step(make_batches(1, 1), 1e-3)   # the next step waits on the failed update
            eng.synchronize()
    finally:
        try:
            eng.close()
        except Exception:
            pass


def test_upload_may_trail_an_update_chunk_by_chunk():
    """wait_version(v, upto=hi): satisfied once the update in progress has written master[:hi];
    a wait past the written part blocks until the update finishes."""
    import threading
    import time

    from slidetune.engine.slide.host_store import HostUnit
    from slidetune.models.load import RandomInit
    from slidetune.engine.adamw import AdamWConfig
    eng = _engine()
    try:
        spec = eng.split.layer_units[0]
    finally:
        eng.close()
    unit = HostUnit(spec, RandomInit(0), AdamWConfig())
    n = spec.numel
    unit.advance(n // 2)                                   # update 1 has written the first half
    unit.wait_version(1, upto=n // 2, poll_s=0.01)         # returns at once
    done = []
    t = threading.Thread(target=lambda: (unit.wait_version(1, upto=n, poll_s=0.01), done.append(1)))
    t.start()
    time.sleep(0.1)
    assert not done                                        # the second half is not written yet
    unit.bump_version()
    t.join(2)
    assert done and unit.progress == 0
    with pytest.raises(RuntimeError, match="will not arrive"):
        abort = threading.Event()
        abort.set()
        unit.wait_version(3, upto=1, abort=abort, poll_s=0.01)  # two updates ahead: progress does not count


def _hold_host(eng):
    """Block the host worker behind a barrier; returns the event that releases it."""
    import threading
    gate = threading.Event()
    eng.threads.host_worker.submit(gate.wait)
    return gate


def _spy_updates(eng) -> list[str]:
    order: list[str] = []
    orig = eng.drainer.consume

    def spy(unit, chunks, **kw):
        order.append(unit.spec.name)
        return orig(unit, chunks, **kw)

    eng.drainer.consume = spy
    return order


@pytest.mark.parametrize("cache_units", [0, 3])
def test_queued_updates_run_in_the_order_the_next_forward_needs_them(cache_units):
    """update_order=deadline: with every gradient of the step down before the host starts,
    the updates run embedding, layer 0, ..., layer L-1, head (the next forward's order),
    not in the order the backward released them; fifo keeps the release order. The
    next step's weights are identical either way (bitwise: the same AdamW per unit)."""
    finals = {}
    for order_name in ("deadline", "fifo"):
        eng = _engine(cache_units=cache_units, update_order=order_name, download_ring=64)
        try:
            L = eng.split.num_layers
            order = _spy_updates(eng)
            gate = _hold_host(eng)
            eng.train_step(make_batches(0, 1), 1e-3)
            eng.threads.d2h_worker.drain()                         # every gradient copy queued
            gate.set()
            eng.synchronize()
            released = ["head"] + [f"layer.{i}" for i in reversed(range(L))] + ["embed"]
            if order_name == "deadline":
                assert order == ["embed"] + [f"layer.{i}" for i in range(L)] + ["head"]
            else:
                assert order == released
            eng.train_step(make_batches(1, 1), 1e-3)
            eng.synchronize()
            finals[order_name] = {k: v.clone() for k, v in eng.named_master_params()}
        finally:
            eng.close()
    for k, v in finals["deadline"].items():
        assert torch.equal(v, finals["fifo"][k]), k


def test_deadline_order_with_a_one_chunk_ring_does_not_deadlock():
    """The host may pick units out of order, but with no unit fully copied it takes the one
    being issued, which frees the ring: a ring of one chunk still makes progress."""
    eng = _engine(cache_units=0, update_order="deadline", download_ring=1, chunk_mb=1)
    try:
        for step in range(3):
            eng.train_step(make_batches(step, 1), 1e-3)
        eng.synchronize()
    finally:
        eng.close()


def test_host_threads_sets_the_host_workers_own_thread_count():
    """host_threads applies to the host worker (AdamW) only; the weights are those of the default."""
    caller = torch.get_num_threads()
    finals = {}
    for threads in (0, 1):
        eng = _engine(cache_units=0, host_threads=threads)
        try:
            if threads:
                assert eng.threads.host_worker.submit(torch.get_num_threads).result() == threads
            assert torch.get_num_threads() == caller
            for step in range(2):
                eng.train_step(make_batches(step, 1), 1e-3)
            eng.synchronize()
            finals[threads] = {k: v.clone() for k, v in eng.named_master_params()}
        finally:
            eng.close()
    for k, v in finals[0].items():
        torch.testing.assert_close(v, finals[1][k], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="host_threads"):
        RuntimeConfig(host_threads=-1)


class _LaggyEvent:
    """A CPU stand-in for a CUDA event that completes some queries after it was recorded,
    as a copy queued behind a backward the GPU has not run yet does."""

    def __init__(self, lag: int):
        self.left = lag

    def query(self) -> bool:
        self.left -= 1
        return self.left < 0

    def synchronize(self) -> None:
        self.left = -1

    def record(self, stream=None) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


def test_deadline_order_waits_for_landed_copies_and_computed_gradients(monkeypatch):
    """Under deadline order the host takes only units whose first chunk has landed and the
    issuer only computed gradients; with events that complete late both keep polling, never
    deadlock (one-chunk ring), and the weights equal those of always-complete events."""
    from slidetune.engine.slide.engine import _landed
    not_landed = []

    def counting(chunk):
        ok = _landed(chunk)
        not_landed.append(not ok)
        return ok

    def train(laggy: bool) -> dict:
        if laggy:
            counter = iter(range(10**9))
            monkeypatch.setattr(Device, "record", lambda self, stream=None, timing=False:
                                _LaggyEvent(next(counter) % 4))
            monkeypatch.setattr(engine, "_landed", counting)
        eng = _engine(cache_units=0, update_order="deadline", download_ring=1, chunk_mb=1)
        try:
            for step in range(3):
                eng.train_step(make_batches(step, 1), 1e-3)
            eng.synchronize()
            return {k: v.clone() for k, v in eng.named_master_params()}
        finally:
            eng.close()
            monkeypatch.undo()
    plain, laggy = train(False), train(True)
    for k, v in plain.items():
        assert torch.equal(v, laggy[k]), k
    assert any(not_landed)                          # the host did find queued-but-not-landed units

    from concurrent.futures import Future
    fut: Future = Future()
    assert not _landed(fut)
    ev = _LaggyEvent(1)
    fut.set_result((0, ev))
    assert not _landed(fut) and _landed(fut)       # queued, then landed
    failed: Future = Future()
    failed.set_exception(RuntimeError("issue failed"))
    assert _landed(failed)                          # the host job runs and reports it


def test_activation_store_keeps_the_last_layers_and_sizes_host_slots_exactly():
    """keep_on_gpu=2 of 4: layers 2 and 3 are never copied to the host; the others get host
    slots of exactly their size (not the pinned allocator's power of two), grown when a larger
    micro-batch comes, and every checkpoint comes back bit for bit."""
    store = activations.ActivationStore(Device.resolve("cpu"), num_layers=4, offload=True, keep_on_gpu=2)
    xs = [torch.randn(1, 3, 5) for _ in range(4)]           # 15 elements: no power of two
    for i, x in enumerate(xs):
        store.save(i, x)
    assert (2, 0) not in store.host and (3, 0) not in store.host
    assert [store.host[(i, 0)].numel() for i in (0, 1)] == [15, 15]
    for i in reversed(range(4)):
        assert torch.equal(store.load(i), xs[i])
    bigger = torch.randn(2, 3, 5)
    store.save(0, bigger)
    assert store.host[(0, 0)].numel() == 30 and torch.equal(store.load(0), bigger)
    # a second micro-batch's checkpoint of the same layer has a slot of its own
    other = torch.randn(1, 3, 5)
    store.save(0, bigger, m=0)
    store.save(0, other, m=1)
    assert torch.equal(store.load(0, m=1), other) and torch.equal(store.load(0, m=0), bigger)
    store.close()
    assert store.host == {}


def test_large_activation_slots_are_registered_in_place_and_released(monkeypatch):
    """Slots of EXACT_PIN_BYTES and more are page-locked in place (exact size), smaller ones come
    from the pinned allocator; growing or closing unregisters exactly the registered ones."""
    device = Device.resolve("cpu")
    calls = []
    monkeypatch.setattr(Device, "register_host", lambda self, t: calls.append(("reg", t.numel())))
    monkeypatch.setattr(Device, "unregister_host", lambda self, t: calls.append(("unreg", t.numel())))
    monkeypatch.setattr(activations.ActivationStore, "EXACT_PIN_BYTES", 64)   # 16 FP32 elements
    store = activations.ActivationStore(device, num_layers=2, offload=True)
    store.save(0, torch.randn(1, 3, 5))       # 60 bytes: the pinned allocator's
    store.save(1, torch.randn(1, 4, 5))       # 80 bytes: registered in place
    assert calls == [("reg", 20)]
    store.load(0), store.load(1)
    store.save(1, torch.randn(2, 4, 5))       # grows: the old one unregistered first
    assert calls == [("reg", 20), ("unreg", 20), ("reg", 40)]
    store.load(1)
    store.close()
    assert calls[-1] == ("unreg", 40) and len(calls) == 4


@pytest.mark.parametrize("mode", ["slide", "gpu"])
def test_long_lived_objects_are_frozen_after_the_first_step_until_close(mode, monkeypatch):
    """gc_freeze (default): after the first step everything then alive sits in Python's permanent
    generation, out of reach of full collections; close() hands it back, so a closed engine in a
    reference cycle can still be freed. gc_freeze=false leaves the collector alone."""
    import gc
    gc.unfreeze()
    freezes = []
    real_freeze = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: (freezes.append(1), real_freeze())[1])
    loaded = make_loaded("llama", tied=False, layers=2)
    eng = build_engine(loaded, RuntimeConfig(mode=mode, dtype="fp32", device="cpu"), AdamWConfig(lr=1e-3))
    try:
        assert gc.get_freeze_count() == 0
        eng.train_step(make_batches(0, 1), 1e-3)
        assert gc.get_freeze_count() > 0 and len(freezes) == 1
        eng.train_step(make_batches(1, 1), 1e-3)
        assert len(freezes) == 1                        # once, not every step
    finally:
        eng.close()
    assert gc.get_freeze_count() == 0
    off = build_engine(loaded, RuntimeConfig(mode=mode, dtype="fp32", device="cpu", gc_freeze=False),
                       AdamWConfig(lr=1e-3))
    try:
        off.train_step(make_batches(0, 1), 1e-3)
        assert gc.get_freeze_count() == 0
    finally:
        off.close()


@pytest.mark.parametrize("clip", [None, 1.0])
def test_the_heads_upload_is_queued_where_its_update_will_be_ready(clip):
    """Eager: the backward releases the head first, so its upload for the next step is queued ahead
    of the last layers' (it hides under theirs). Clipped: the sweep updates a host head last, and the
    uploader runs in order, so the head's upload is queued behind every layer's: queued earlier it
    would hold back the layers behind it until the sweep's end (NOTES.md "PCIe uploads")."""
    # 8 layers: 2 resident (0-1, a slot each), a 2-slot window over 2-7; the forward plans 2 visits
    # ahead, so an early head is queued before layers 6 and 7
    loaded = make_loaded("llama", tied=False, layers=8)
    eng = build_engine(loaded, RuntimeConfig(mode="slide", dtype="fp32", device="cpu", cache_units=2,
                                             resident_layers=2), AdamWConfig(lr=1e-3), max_grad_norm=clip)
    try:
        assert eng.resident_layers == 2
        uploads = _spy_uploads(eng)
        for step in range(2):
            eng.train_step(make_batches(step, 1), 1e-3)
        eng.synchronize()
        # step 0's forward (version 0: the initial weights), in the order the uploads were queued
        forward = [name for name, v in uploads if v == 0 and (name == "head" or name.startswith("layer."))]
        if clip:
            assert forward.index("head") > forward.index("layer.7")
        else:
            assert forward.index("head") < forward.index("layer.6")
        # clipped, the next step's too (the weights the sweep wrote, version 1)
        if clip:
            forward = [name for name, v in uploads if v == 1 and (name == "head" or name.startswith("layer."))]
            assert forward.index("head") > forward.index("layer.7")
    finally:
        eng.close()


def test_synchronize_waits_for_uploads_the_follower_releases():
    """Data parallel: the follower thread counts another rank's update of a unit, and that releases
    the uploads registered on it (HostUnit.begin_update). synchronize() drains the follower before
    the uploader, so an upload the follower submits late is finished when it returns (drained the
    other way, it was not: test_data_parallel's upload count once read one unit short)."""
    import time
    from slidetune.engine.slide.workers import Worker
    eng = _engine()
    try:
        eng.threads.follower = Worker("follow", eng.threads.on_error)      # as a data-parallel engine has
        done: list[int] = []

        def late_release():
            time.sleep(0.3)                                          # the owner's update lands late
            eng.threads.upload_worker.submit(lambda: (time.sleep(0.05), done.append(1)))
        eng.threads.follower.submit(late_release)
        eng.synchronize()
        assert done == [1]
    finally:
        eng.close()
