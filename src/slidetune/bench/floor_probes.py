"""The probes the floor of a slide step is built from (bench.roofline), each a short measurement
on this machine:
  copies   pinned <-> device bandwidth each way and both at once (1 GiB transfers): probe_copy;
  AdamW    the host AdamW over a flat FP32 tensor, params/s at the current thread count, through
           the engine's kernel (--tuning.host_adamw), on BF16 gradients or FP32 ones, and the
           host DRAM bandwidth beside it: probe_adamw, probe_host_dram; the GPU's AdamW of the
           units updated there: probe_device_adamw;
  disk     the disk tier's directory read, written and both at once: probe_disk;
  compute  one decoder layer resident on the GPU (forward, recompute + backward), the head and
           the embedding, as the slide engine runs them: probe_compute.
"""
from __future__ import annotations

import contextlib
import functools
import os
import queue
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..engine import native_adamw
from ..engine.adamw import FP32_ADAMW, AdamWConfig, FlatAdamW, OptimizerState, optimizer_state
from ..engine.config import RuntimeConfig
from ..models.load import RandomInit, load_model
from ..telemetry.flops import train_flops_per_token


PROGRESS_VAR = "SLIDETUNE_PROBE_PROGRESS"     # set by `plan --terms`: each probe's seconds on stderr as it ends


@contextlib.contextmanager
def probing(what: str):
    """Each probe's wall time on stderr where SLIDETUNE_PROBE_PROGRESS is set (`plan --terms` shows the
    worker's stderr live: on 2026-11-29 its probes on the H200 ran past 540 s with nothing said)."""
    start = time.perf_counter()
    yield
    if os.environ.get(PROGRESS_VAR):
        print(f"  probed {what}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def _time_cuda(fn, reps: int = 5, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def probe_copy(nbytes: int = 2**30) -> dict:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = _time_cuda(lambda: dev.copy_(host, non_blocking=True))
    d2h = _time_cuda(lambda: host.copy_(dev, non_blocking=True))
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        cur = torch.cuda.current_stream()
        s1.wait_stream(cur)
        s2.wait_stream(cur)
        with torch.cuda.stream(s1):
            dev.copy_(host, non_blocking=True)
        with torch.cuda.stream(s2):
            host2.copy_(dev2, non_blocking=True)
        cur.wait_stream(s1)
        cur.wait_stream(s2)
    bidir = _time_cuda(both)
    pageable = torch.empty(nbytes // 4, dtype=torch.uint8)
    pg = _time_cuda(lambda: dev[: nbytes // 4].copy_(pageable), reps=3, warmup=1)
    gib = 2**30
    return {"h2d_gib_s": nbytes / h2d / gib, "d2h_gib_s": nbytes / d2h / gib,
            "bidirectional_total_gib_s": 2 * nbytes / bidir / gib, "pageable_h2d_gib_s": nbytes / 4 / pg / gib}


def _adamw_rate(n: int, steps: int, grad_dtype: torch.dtype, kernel: str, part: str = "all",
                state: OptimizerState = FP32_ADAMW) -> float:
    """params/s of the median step: one step that a page fault, a timer tick or a neighbour
    stretched must not set the floor (three-step means ranged 3.8-6.7 G params/s on the H100
    host, NOTES.md "Floor probes"). state: the units' state format (--moments)."""
    master = torch.randn(n).to(state.master_dtype)
    grad = torch.randn(n).to(grad_dtype)
    opt = FlatAdamW(master, n, AdamWConfig(weight_decay=0.1), kernel, state_format=state)
    # clip_sweep=weights' first pass writes BF16 weights (the upload copy) instead of the master
    weights = torch.empty(n, dtype=torch.bfloat16) if part == "weights" else None
    opt.begin_step()
    opt.update(grad, 1e-5)              # first touch of the moments, outside the timing
    if weights is not None:
        weights.zero_()                 # ... and of the copy
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.begin_step()
        opt.update(grad, 1e-5, part=part, weights=weights)
        times.append(time.perf_counter() - t)
    return n / statistics.median(times)


# Host DRAM bytes per parameter of the AdamW passes, reads + writes: the optimizer's state
# (FP32_ADAMW: master p 4, moments m and v 8) and a BF16 gradient g (2; FP32: 4). One pass reads
# p, m, v, g and writes p, m, v; the clipped sweep's pair reads p, m, v, g and writes p, then reads
# m, v, g and writes m, v; clip_sweep=weights' first pass reads p, m, v, g and writes the BF16
# weights, its second is the whole update.
def adamw_bytes(state: OptimizerState = FP32_ADAMW) -> dict[str, int | float]:
    """Each probe's bytes per parameter for a state format (OptimizerState.update_bytes): FP32 26,
    28, 18, 18, 16; the compact formats have no weights-copy pass (clip_sweep=weights is refused
    with them)."""
    out = {"adamw_bf16_grad_params_per_s": state.update_bytes(2),
           "adamw_fp32_grad_params_per_s": state.update_bytes(4),
           "adamw_weights_pass_params_per_s": state.update_bytes(2, "params"),
           "adamw_moments_pass_params_per_s": state.update_bytes(2, "moments")}
    if state is FP32_ADAMW:
        out["adamw_weights_copy_pass_params_per_s"] = state.bytes_per_param + 2 + 2
    return out


ADAMW_BYTES = adamw_bytes(FP32_ADAMW)


def _probed_state(adamw: dict) -> OptimizerState:
    """The state format an AdamW probe measured (probe_adamw's "master" and "moments"; FP32 where absent)."""
    return optimizer_state(adamw.get("master", "fp32"), adamw.get("moments", "fp32"))


def probe_host_dram(n: int = 256 * 2**20, reps: int = 5) -> dict:
    """The host's DRAM bandwidth as the AdamW loop can use it: a += b over FP32 arrays far larger
    than the caches, on the calling thread's torch threads (12 B per element: two reads, one
    write back in place, as AdamW writes its state; an out-of-place c = a + b also reads c's
    lines before writing them, 16 B moved for 12 counted: 16 against 25 GiB/s on the CPU
    machine). Median of `reps`."""
    a, b = torch.ones(n), torch.ones(n)
    a.add_(b)                               # first touch, outside the timing
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a.add_(b)
        times.append(time.perf_counter() - t)
    return {"dram_gib_s": 12 * n / statistics.median(times) / 2**30, "dram_threads": torch.get_num_threads()}


def adamw_dram_use(adamw: dict, dram: dict) -> dict:
    """Each probed AdamW rate as the DRAM bandwidth it moves (rate x bytes per parameter) and as a
    fraction of the probed bandwidth: how far the loop is from the memory's limit."""
    out = {}
    for key, nbytes in adamw_bytes(_probed_state(adamw)).items():
        if adamw.get(key):
            gib_s = adamw[key] * nbytes / 2**30
            out[key.replace("_params_per_s", "_gib_s")] = gib_s
            out[key.replace("_params_per_s", "_of_dram")] = gib_s / dram["dram_gib_s"]
    return out


def probe_adamw(n: int = 128 * 2**20, steps: int = 11, grad_download: str = "compute",
                host_adamw: str = "dynamic", moments: str = "fp32", master: str = "fp32") -> dict:
    """The host AdamW's rate over one flat tensor through the engine's kernel (host_adamw:
    native_adamw's loop, or torch's fused kernel), on FP32 gradients and, where the native
    kernel reads them, on BF16 ones. `adamw_params_per_s` is the rate of the path the
    engine takes: BF16 under grad_download=compute where the native kernel runs.
    moments, master: the host units' state format (--moments, --master; a compact one through the
    native kernel only)."""
    state = optimizer_state(master, moments)
    fp32 = _adamw_rate(n, steps, torch.float32, host_adamw, state=state)
    out = {"adamw_fp32_grad_params_per_s": fp32, "threads": torch.get_num_threads(), "host_adamw": host_adamw,
           "moments": moments, "master": master}
    native = host_adamw != "torch" and native_adamw.load() is not None
    if native:
        out["adamw_bf16_grad_params_per_s"] = _adamw_rate(n, steps, torch.bfloat16, host_adamw, state=state)
        # the clipped sweep's weights-only pass (deferred schedule): BF16 held gradients
        out["adamw_weights_pass_params_per_s"] = _adamw_rate(n, steps, torch.bfloat16, host_adamw, part="params",
                                                             state=state)
        out["adamw_moments_pass_params_per_s"] = _adamw_rate(n, steps, torch.bfloat16, host_adamw, part="moments",
                                                             state=state)
        if state is FP32_ADAMW:
            # clip_sweep=weights: the first pass writes the BF16 upload copy (the second is the whole update)
            out["adamw_weights_copy_pass_params_per_s"] = _adamw_rate(n, steps, torch.bfloat16, host_adamw,
                                                                      part="weights")
    out["kernel"] = f"native ({host_adamw})" if native else "torch"
    dram = probe_host_dram()
    out.update(dram, **adamw_dram_use(out, dram))
    widened = grad_download == "compute" and "adamw_bf16_grad_params_per_s" in out
    out["grad_dtype"] = "bf16" if widened else "fp32"
    out["adamw_params_per_s"] = out["adamw_bf16_grad_params_per_s"] if widened else fp32
    return out


def probe_disk(directory: str, total_bytes: int = 4 * 2**30, block_mb: int = 64, threads: int = 4,
               warm_passes: int = 1, repeats: int = 1, files: int = 1, mixed: str = "pool") -> dict:
    """Read and write bandwidth of `directory` as the disk tier uses it (engine/slide/disk_tier.py):
    O_DIRECT where the filesystem allows it, blocks of `block_mb` MiB (a block's two moments), at a
    queue depth of `threads` (its I/O threads), over `files` files of `total_bytes` in all (block k
    in file k % files): written, then read, then both at once (the tier reads ahead while it writes
    behind). GiB/s each.

    mixed: how the "both at once" pass shares the threads.
      pool  (the tier's way): one pool of `threads` threads takes reads and writes, alternating, from
            one queue, so the slower kind holds more of the threads. On the H100 machine's disk, where
            reads are the slow kind, this is what the tier drew (NOTES.md "Disk tier").
      split half the threads only read and half only write: the reads get half the queue depth. It
            read 1.45 GiB/s where the tier moved 1.79 (a floor above the step, NOTES.md "Disk tier").

    warm_passes: untimed writes of the whole file first. The tier rewrites the same blocks every
    step, and a first write into fresh extents (ext4's unwritten extents, a thin-provisioned
    virtual disk's first touch) can be several times slower than a rewrite: the steady state
    is what a step sees. The first pass's rate is reported too (first_write_gib_s).

    repeats: each timed pass (write, read, mixed) that many times, the fastest kept (all in
    `passes`). A virtual disk's rate varies from one pass to the next (the H100 machine's mixed
    rate read 1.15 and 1.88 GiB/s in one hour, NOTES.md "Disk tier"), and a floor needs the disk's
    best: a step measured below a floor built on a slow pass (0.79x) showed the floor wrong."""
    from ..engine.slide.disk_tier import block_elems
    from ..engine.tiers import check_directory
    if mixed not in ("pool", "split"):
        raise ValueError(f"mixed must be pool or split, not {mixed!r}")
    block_bytes = FP32_ADAMW.moment_bytes * block_elems(block_mb)      # a moments-only block
    files = max(1, files)
    n_blocks = max(threads, files, total_bytes // block_bytes)
    per_file = -(-n_blocks // files)                       # blocks in each file (the last may hold fewer)
    root = check_directory(directory, files * per_file * block_bytes)
    direct = hasattr(os, "O_DIRECT")
    fds: list[int] = []
    paths = [tempfile.mktemp(prefix="slidetune-disk-probe-", dir=root) for _ in range(files)]
    try:
        direct = _open_probe_files(paths, fds, direct)
        for fd in fds:
            os.posix_fallocate(fd, 0, per_file * block_bytes)
        bufs = _probe_buffers(threads, block_bytes)
        run = functools.partial(_disk_pass, fds=fds, bufs=bufs, block_bytes=block_bytes, n_blocks=n_blocks,
                                threads=threads, mixed=mixed)
        first_write = run([True]) if warm_passes > 0 else None
        for _ in range(warm_passes - 1):
            run([True])
        passes = {"write": [], "read": [], "mixed": []}
        for _ in range(max(1, repeats)):
            passes["write"].append(run([True]))
            passes["read"].append(run([False]))
            passes["mixed"].append(run([False, True]))
        write, read, mixed_rate = (max(passes[k]) for k in ("write", "read", "mixed"))
    finally:
        for fd in fds:
            os.close(fd)
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)
    return {"read_gib_s": read, "write_gib_s": write, "mixed_gib_s": mixed_rate, "first_write_gib_s": first_write,
            "warm_passes": warm_passes, "passes": passes, "direct_io": direct, "mixed": mixed, "files": files,
            "block_mib": block_bytes / 2**20, "threads": threads, "bytes": n_blocks * block_bytes,
            "directory": str(root)}


def _open_probe_files(paths: list[str], fds: list[int], direct: bool) -> bool:
    """Open (create) each probe file into `fds`, with O_DIRECT while the filesystem allows it; returns
    whether O_DIRECT held (a file it refused is opened without it, and so are those after it)."""
    for path in paths:
        try:
            fds.append(os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o600))
        except OSError:
            direct = False
            fds.append(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    return direct


def _probe_buffers(threads: int, block_bytes: int) -> queue.SimpleQueue:
    """One aligned block buffer per thread, filled with random bytes (nothing a disk could compress)."""
    from ..engine.slide.disk_tier import ALIGN, _aligned_empty
    bufs: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(threads):
        b = memoryview(_aligned_empty(block_bytes // 4, pinned=False).numpy()).cast("B")
        b[:] = os.urandom(ALIGN) * (len(b) // ALIGN)
        bufs.put(b)
    return bufs


def _disk_pass(kinds: list[bool], *, fds: list[int], bufs: queue.SimpleQueue, block_bytes: int, n_blocks: int,
               threads: int, mixed: str) -> float:
    """Every block once, op k of kind kinds[k % len(kinds)] (True: a write): queued to one pool (pool),
    or each thread its own share (split: thread w takes blocks w, w + threads, ..., all of one kind
    where threads is even); then fsync. GiB/s."""
    files = len(fds)

    def op(write: bool, k: int) -> None:
        buf = bufs.get()
        try:
            (os.pwritev if write else os.preadv)(fds[k % files], [buf], (k // files) * block_bytes)
        finally:
            bufs.put(buf)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        if mixed == "pool" or len(kinds) == 1:
            futs = [pool.submit(op, kinds[k % len(kinds)], k) for k in range(n_blocks)]
        else:
            def share(w: int) -> None:
                for k in range(w, n_blocks, threads):
                    op(kinds[w % len(kinds)], k)
            futs = [pool.submit(share, w) for w in range(threads)]
        for f in futs:
            f.result()
    for fd in fds:
        os.fsync(fd)
    return n_blocks * block_bytes / (time.perf_counter() - t0) / 2**30


def probe_device_adamw(n: int = 64 * 2**20, chunk: int = 64 * 2**20) -> dict:
    """The GPU's AdamW as the slide engine runs it for units updated on the device (FlatAdamW
    over an FP32 master, BF16 gradient widened a chunk at a time): params/s, median of 5."""
    dev = torch.device("cuda")
    master = torch.randn(n, device=dev)
    grad = torch.randn(n, device=dev).to(torch.bfloat16)
    scratch = torch.empty(min(chunk, n), device=dev)
    opt = FlatAdamW(master, n, AdamWConfig(weight_decay=0.1))

    def step():
        opt.begin_step()
        opt.update_widened(grad, 1e-5, scratch)
    return {"device_adamw_params_per_s": n / _time_cuda(step)}


def probe_compute(model: str, batch: int, seq: int, num_layers: int | None = None,
                  head_impl: str = "chunked", head_chunk_tokens: int = 4096, compile_layers: bool = False,
                  lean_row_tokens: int = 16384, mlp_tile_tokens: int = 8192, layer: str = "both") -> dict:
    """Times of one resident layer and of head/embedding, in bf16 on the GPU, each run as the slide
    engine runs it: the layer through the engine's LayerRunner, the head through head_loss_and_grads.

    layer: which decoder layer is timed: "hf" (HF's), "lean" (the lean one, where the family's layer
    can run lean; lean_layer_*_s, which compute_of_run puts in the floor of a run that resolved
    lean_layer on) or "both". A sweep probes the layer its run resolved: each compiled probe of a
    64K-token layer costs about a minute of compile and timing.
    compile_layers: the layers torch.compile'd (the compile itself falls in the untimed warm-up
    calls)."""
    if layer not in ("hf", "lean", "both"):
        raise ValueError(f"probe_compute: layer must be hf, lean or both, got {layer!r}")
    from ..device import Device
    from ..models.lean_layer import lean_support_reason
    from ..engine.slide.layer_runner import LayerRunner
    from ..telemetry.events import EventTimer
    dev, dtype = torch.device("cuda"), torch.bfloat16
    loaded = load_model(model, num_layers=num_layers, with_tokenizer=False)
    split = loaded.split
    init = RandomInit(0)

    def params(unit):
        flat = torch.empty(unit.numel)
        init.fill(unit, flat)
        flat = flat.to(dev, dtype)
        return {k: v.requires_grad_(True) for k, v in unit.views(flat).items()}

    layer_params = params(split.layer_units[0])
    embed = params(split.embed_unit)
    head = params(split.head_unit)
    kwargs = split.layer_kwargs(batch, seq, dtype, dev)
    x = torch.randn(batch, seq, split.hidden_size, device=dev, dtype=dtype)
    g = torch.randn_like(x)
    ids = torch.randint(0, split.config.vocab_size, (batch, seq), device=dev)
    labels = torch.randint(0, split.config.vocab_size, (batch, seq), device=dev)
    split.attach_sides(kwargs, embed, ids, split.embed_forward(embed, ids).detach())   # Gemma 4 E2B / E4B
    untimed = EventTimer(Device(dev), enabled=False)       # the runner's spans, not recorded

    def layer_times(lean: str) -> tuple[float, float]:
        rt = RuntimeConfig(mode="slide", device="cuda", dtype="bf16", compile_layers="on" if compile_layers else "off",
                           lean_layer=lean, layer_row_tokens=lean_row_tokens, mlp_tile_tokens=mlp_tile_tokens)
        runner = LayerRunner(split, rt, dev)

        def fwd():
            with torch.no_grad():
                runner.forward(0, layer_params, x, kwargs[0])

        def recompute_backward():
            runner.recompute_backward(0, layer_params, x, g.clone(), kwargs[0], untimed)     # consumes its dy
        return _time_cuda(fwd), _time_cuda(recompute_backward)

    def head_fb():
        tied = embed["weight"] if split.tied else None
        split.head_loss_and_grads(head, x, labels, 1.0 / (batch * seq), lm_weight=tied, impl=head_impl,
                                  chunk_tokens=head_chunk_tokens)

    def embed_fb():
        e = split.embed_forward(embed, ids)
        torch.autograd.grad(e, [embed["weight"]], g)

    lean_runs = layer != "hf" and lean_support_reason(split) is None
    lean = {}
    if lean_runs:
        lean_fwd, lean_rb = layer_times("on")
        lean = {"lean_layer_forward_s": lean_fwd, "lean_layer_recompute_backward_s": lean_rb}
    # layer_*_s: HF's layer; probed for the lean layer alone, the lean one's (the run's layer either way)
    t_fwd, t_rb = layer_times("off") if layer != "lean" or not lean_runs else (lean_fwd, lean_rb)
    t_head = _time_cuda(head_fb)
    t_embed = _time_cuda(embed_fb)
    L = split.num_layers
    compute = L * (t_fwd + t_rb) + t_head + t_embed
    flops = train_flops_per_token(split, seq) * batch * seq
    return {"layer_forward_s": t_fwd, "layer_recompute_backward_s": t_rb, **lean, "head_s": t_head,
            "embed_s": t_embed, "compute_s": compute, "model_tflops_at_floor": flops / compute / 1e12,
            "params": split.num_params(), "layer_params": split.layer_units[0].numel,
            "vocab_params": split.embed_unit.numel + split.head_unit.numel, "num_layers": L,
            "embed_params": split.embed_unit.numel,
            "compile_layers": compile_layers, "layer_probed": layer if lean_runs else "hf"}


def compute_of_run(comp: dict, runtime: dict | None) -> dict:
    """The compute probe as a run used it: where the run resolved lean_layer on, the lean layer's
    times in place of HF's (and compute_s with them); else the probe as it is."""
    if not runtime or runtime.get("lean_layer") != "on" or "lean_layer_recompute_backward_s" not in comp:
        return comp
    out = {**comp, "layer_forward_s": comp["lean_layer_forward_s"],
           "layer_recompute_backward_s": comp["lean_layer_recompute_backward_s"]}
    out["compute_s"] = comp["compute_s"] + comp["num_layers"] * (
        out["layer_forward_s"] + out["layer_recompute_backward_s"] - comp["layer_forward_s"]
        - comp["layer_recompute_backward_s"])
    return out
