"""The floor of a slide step on this machine, from short probes.

floor = max(GPU compute, weight bytes H2D / H2D bandwidth, gradient bytes D2H / D2H
bandwidth, parameters / CPU AdamW rate). Each term is measured here, not assumed:
  compute  one decoder layer resident on the GPU: forward (no autograd) + recompute +
           backward, times the number of layers, plus head and embedding;
  copies   pinned <-> device bandwidth each way and both at once (1 GiB transfers);
  AdamW    the host AdamW over a flat FP32 tensor, params/s at the current thread count,
           through the engine's kernel (--tuning.host_adamw), on BF16 gradients
           (grad_download=compute, the default) or FP32 ones; and the GPU's AdamW of the units
           updated there (vocab_update=device, device_layers), added to compute;
  collective  N data-parallel ranks on one host: the gradient all-reduce at the bus bandwidth
           bench.collective probed at N ranks, on the compute stream (floor_terms, `ranks`).

The hardware floor: the same terms with the GPU's work at what this GPU can do rather than what
slidetune's layer takes (a slow layer would otherwise sit "1.01x its floor"): the step's FLOPs,
recomputation counted (telemetry.flops.StepFlops), matmuls at the BF16 GEMM rate cuBLAS gets on
the layer's own shapes and attention at SDPA's rate at the workload's shape, both probed here
(probe_hardware, hardware_compute); the GPU's AdamW and the all-reduce stay as they are.
"""
from __future__ import annotations

import functools
import os
import queue
import statistics
import tempfile
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from ..engine import native_adamw
from ..engine.adamw import FP32_ADAMW, AdamWConfig, FlatAdamW, OptimizerState, optimizer_state
from ..engine.config import RuntimeConfig, runtime_fields
from ..engine.distributed import plan_owners, shared_layout
from ..engine.placement import PlacementPlan, shapes_from_counts
from ..models.load import RandomInit, load_model
from ..models.units import SplitModel
from ..telemetry.flops import (FLASH_BACKWARD_OVER_FORWARD, StepFlops, attention_width, causal_attention_flops,
                               step_flops, train_flops_per_token)
from .collective import allgather_seconds, allreduce_term


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
    from ..engine.slide.disk_tier import block_elems, check_directory
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
    from ..engine.fit import lean_support_reason
    from ..engine.slide.layer_runner import LayerRunner
    from ..telemetry.events import EventTimer
    dev = torch.device("cuda")
    dtype = torch.bfloat16
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


# ---------------------------------------------------------------- the hardware floor's rates
# Rows of the GEMM probe: the step's tokens, at most this many. Past ~64K rows a layer's GEMMs run
# at one rate (their output tiles fill the GPU's SMs many times over), and the probe's tensors stay
# small: x, dX and dY of Llama-3.1-8B's down_proj at 65536 rows, 2 x 14336 + 4096 wide, 4.3 GB.
GEMM_PROBE_MAX_ROWS = 65536


def layer_gemm_shapes(split: SplitModel, tokens: int) -> list[dict]:
    """The matrix products of one forward of decoder layer 0 over `tokens` rows (at most
    GEMM_PROBE_MAX_ROWS), one entry per distinct shape with its count: {rows, in, out, count}, an
    nn.Linear's weight W [out, in], y [rows, out] = x [rows, in] @ W^T (Qwen3-8B: q and o 4096 x
    4096, k and v 1024 x 4096, gate and up 12288 x 4096, down 4096 x 12288). An MoE layer's expert
    banks (3-D) are left out: their GEMMs run per expert group, on other shapes."""
    rows = min(tokens, GEMM_PROBE_MAX_ROWS)
    counts: dict[tuple[int, int], int] = {}
    for p in split.layer_units[0].params:
        if len(p.shape) == 2:
            counts[p.shape] = counts.get(p.shape, 0) + 1
    return [{"rows": rows, "in": n_in, "out": n_out, "count": c} for (n_out, n_in), c in counts.items()]


def probe_gemm(shapes: list[dict], dtype: torch.dtype = torch.bfloat16) -> dict:
    """What cuBLAS gets on these matrix products in `dtype` on this GPU ({rows, in, out, count}
    each, layer_gemm_shapes; a square probe is one shape), forward and backward:
      forward   y = x W^T    [rows, in] @ [in, out]
      backward  dX = dY W    [rows, out] @ [out, in], and dW = dY^T X  [out, rows] @ [rows, in]
    each the median of 5 CUDA-event-timed calls; the rates are the FLOPs over the time summed over
    the shapes with their counts (the mix one layer runs). TFLOP/s, and per shape."""
    dev = torch.device("cuda")
    per_shape, fwd_flops, fwd_s, bwd_s = [], 0.0, 0.0, 0.0
    for shape in shapes:
        rows, n_in, n_out, count = shape["rows"], shape["in"], shape["out"], shape.get("count", 1)
        x = torch.randn(rows, n_in, device=dev, dtype=dtype)             # [rows, in]
        w = torch.randn(n_out, n_in, device=dev, dtype=dtype)            # [out, in]
        dy = torch.randn(rows, n_out, device=dev, dtype=dtype)           # [rows, out]
        flops = 2.0 * rows * n_in * n_out
        t_fwd = _time_cuda(lambda: torch.nn.functional.linear(x, w))
        t_bwd = _time_cuda(lambda: (dy @ w, dy.t() @ x))
        per_shape.append({**shape, "forward_tflops": flops / t_fwd / 1e12, "backward_tflops": 2 * flops / t_bwd / 1e12})
        fwd_flops, fwd_s, bwd_s = fwd_flops + count * flops, fwd_s + count * t_fwd, bwd_s + count * t_bwd
        del x, w, dy
    return {"gemm_forward_tflops": fwd_flops / fwd_s / 1e12, "gemm_backward_tflops": 2 * fwd_flops / bwd_s / 1e12,
            "gemm_tflops": 3 * fwd_flops / (fwd_s + bwd_s) / 1e12, "gemm_dtype": str(dtype).removeprefix("torch."),
            "gemm_shapes": per_shape}


def probe_sdpa(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int,
               dtype: torch.dtype = torch.bfloat16) -> dict:
    """SDPA's rate on this GPU at the workload's shape, as HF's sdpa attention calls it on a batch
    without padding (is_causal=True; enable_gqa where KV heads are grouped; q, k, v transposed views
    of [B, S, H, dh] projections, as the layer passes them): the forward (no grad) and the backward
    (dQ, dK, dV of a kept forward), each the median of 5 timed calls, and the backend SDPA picks
    for the call (torch._fused_sdp_choice: flash, cuDNN, ...). FLOPs:
    telemetry.flops.causal_attention_flops, the backward FLASH_BACKWARD_OVER_FORWARD x it."""
    dev = torch.device("cuda")

    def leaf(h: int) -> torch.Tensor:                       # [B, h, S, dh], a view of [B, S, h, dh]
        return torch.randn(batch, seq, h, head_dim, device=dev, dtype=dtype).transpose(1, 2).requires_grad_()
    q, k, v = leaf(heads), leaf(kv_heads), leaf(kv_heads)
    gqa = {"enable_gqa": True} if kv_heads != heads else {}

    def forward():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)                       # [B, H, S, dh]
    grad = torch.randn_like(out)
    t_fwd = _time_cuda(forward)
    t_bwd = _time_cuda(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
    flops = causal_attention_flops(batch, heads, seq, head_dim)
    bwd = FLASH_BACKWARD_OVER_FORWARD * flops
    return {"sdpa_forward_tflops": flops / t_fwd / 1e12, "sdpa_backward_tflops": bwd / t_bwd / 1e12,
            "sdpa_tflops": (flops + bwd) / (t_fwd + t_bwd) / 1e12,
            "sdpa_shape": {"batch": batch, "heads": heads, "kv_heads": kv_heads, "seq": seq, "head_dim": head_dim},
            "sdpa_backend": sdpa_backend(q, k, v, gqa)}


def sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: dict) -> str | None:
    """The backend SDPA's dispatcher picks for this causal call with gradients (None where this
    torch cannot say)."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return None
    try:
        index = int(choose(q, k, v, None, 0.0, True, **gqa))
    except (RuntimeError, TypeError):
        return None
    from torch.nn.attention import SDPBackend
    return next((name for name, b in SDPBackend.__members__.items() if int(b.value) == index), str(index))


def probe_hardware(split: SplitModel, batch: int, seq: int) -> dict:
    """The hardware floor's inputs for `batch` x `seq` tokens of this model: the BF16 GEMM rates on
    its layer's own shapes (probe_gemm), SDPA's at its attention shape (probe_sdpa), and the step's
    FLOPs (telemetry.flops.step_flops: per layer, one forward each), so that hardware_compute can
    price any run's recomputation and a reader can redo the arithmetic."""
    c = split.config
    heads = int(c.num_attention_heads)
    head_dim = attention_width(c) // heads
    out = probe_gemm(layer_gemm_shapes(split, batch * seq))
    out.update(probe_sdpa(batch, heads, int(getattr(c, "num_key_value_heads", None) or heads), seq, head_dim))
    torch.cuda.empty_cache()
    return {**out, "flops": step_flops(split, batch, seq).as_dict()}


def hardware_compute(hw: dict, recomputed: Collection[int]) -> dict:
    """The compute probe's terms (probe_compute's keys) at the hardware's rates (probe_hardware):
    each FLOP of the step (telemetry.flops.StepFlops; the `recomputed` layers run their forward
    twice) at the probed rate of its kind,

        compute_s = matmul forward / gemm_forward_tflops + matmul backward / gemm_backward_tflops
                  + attention forward / sdpa_forward_tflops + attention backward / sdpa_backward_tflops

    the head's logits a forward matmul, its two gradients backward ones. The embedding (a gather
    and its scatter) costs nothing here; nor does elementwise work (norms, rotary, SiLU, the
    softmax of the loss): a floor no kernel can beat. layer_forward_s is one layer's forward (the
    mean over layers), layer_recompute_backward_s the rest of a layer's share of the step, so that
    L x (layer_forward_s + layer_recompute_backward_s) + head_s = compute_s as for the probe."""
    f = StepFlops.from_dict(hw["flops"])
    rc = set(recomputed)
    gemm_f, gemm_b = hw["gemm_forward_tflops"] * 1e12, hw["gemm_backward_tflops"] * 1e12
    sdpa_f, sdpa_b = hw["sdpa_forward_tflops"] * 1e12, hw["sdpa_backward_tflops"] * 1e12
    compute_s = (f.matmul_forward(rc) / gemm_f + f.matmul_backward() / gemm_b
                 + f.attention_forward(rc) / sdpa_f + f.attention_backward() / sdpa_b)
    head_s = f.head_matmul / gemm_f + 2 * f.head_matmul / gemm_b
    L = f.num_layers
    layer_forward_s = (sum(f.layer_matmul) / gemm_f + sum(f.layer_attention) / sdpa_f) / L
    return {"compute_s": compute_s, "layer_forward_s": layer_forward_s,
            "layer_recompute_backward_s": (compute_s - head_s) / L - layer_forward_s,
            "head_s": head_s, "embed_s": 0.0, "matmul_flops": f.matmul(rc), "attention_flops": f.attention(rc),
            "recomputed_layers": len(rc)}


def plan_of_runtime(comp: dict, runtime: dict | None = None, clipped: bool = False) -> PlacementPlan:
    """The placement plan of a run, from its resolved RuntimeConfig (as bench.measure records it) and
    the probe's shapes; -1 and auto, left unresolved, mean what an engine built directly does
    (nothing on the GPU, a 3-slot window). No runtime: the design's placement, every unit on the
    host. clipped: the run clipped by the global norm (its max_grad_norm > 0)."""
    known = runtime_fields()
    rt = RuntimeConfig(**{k: v for k, v in (runtime or {}).items() if k in known})
    schedule = "deferred" if clipped or rt.clip.schedule == "deferred" else "eager"
    vocab = comp["vocab_params"]
    embed = comp.get("embed_params", vocab // 2)
    shapes = shapes_from_counts(comp["num_layers"], comp["layer_params"], embed, vocab - embed)
    return PlacementPlan.build(shapes, rt, schedule)


def disk_term(plan: PlacementPlan, disk: dict) -> float:
    """Seconds a step the disk tier's I/O takes (probe_disk's result): each disk unit's block is read
    and written once a step (PlacementPlan.disk_io_bytes: 16 B/param, 24 with its master on disk).
    The tier reads ahead while it writes behind: at the probe's mixed rate (reads and writes at
    once); a probe without it, one after the other."""
    gib = 2**30
    io = plan.disk_io_bytes()
    if disk.get("mixed_gib_s"):
        return io / (disk["mixed_gib_s"] * gib)
    return io / 2 / (disk["read_gib_s"] * gib) + io / 2 / (disk["write_gib_s"] * gib)


# Bytes of host DRAM an upload reads per parameter: the FP32 master (the GPU-cast path page-locks it
# and DMAs it as is; the CPU-cast path reads it too, and writes and re-reads a BF16 copy besides).
# The floor takes the plan's (host_state.master_bytes): a BF16 master (--master bf16) is read as is, 2.
UPLOAD_READ_BYTES = FP32_ADAMW.master_bytes


def largest_shard(plan: PlacementPlan, ranks: int) -> int:
    """Parameters of the host-updated units the busiest of `ranks` local ranks owns: only a unit's
    owner copies its gradient down and runs its AdamW. The owners as SlideEngine assigns them
    (distributed.plan_owners: the host-updated units balanced, the disk tier's on local rank 0);
    units updated on the GPU have no owner (every rank updates its own copy). One rank: every
    host-updated parameter."""
    if ranks <= 1:
        return plan.host_updated_params
    numels, _ = shared_layout(plan)
    owners = plan_owners(plan, ranks)
    load = [0] * ranks
    for n, r in zip(numels, owners):
        load[r] += n
    return max(load)


def adamw_dram_bytes(plan: PlacementPlan, adamw: dict, split_sweep: bool = True) -> int:
    """Host DRAM bytes of the host's AdamW a step (ADAMW_BYTES): one pass over each host-updated
    unit (26 B/param, 28 with FP32 gradients); clipped with the split sweep (probed), the units
    with master and moments in RAM take both passes (18 + 18), those with an upload copy the
    copy pass and the whole update (16 + 26); disk units one whole pass."""
    key = "adamw_bf16_grad_params_per_s" if adamw.get("grad_dtype") == "bf16" else "adamw_fp32_grad_params_per_s"
    ram = adamw_bytes(plan.host_state)          # the RAM units' format (--moments); disk units FP32
    ram_params, disk_params = plan.params("host"), plan.params("disk")
    if plan.schedule != "deferred" or not split_sweep or not adamw.get("adamw_moments_pass_params_per_s"):
        return ram[key] * ram_params + ADAMW_BYTES[key] * disk_params
    copies = plan.upload_copy_numel()
    split = ram_params - copies
    passes = ram["adamw_weights_pass_params_per_s"] + ram["adamw_moments_pass_params_per_s"]
    return (passes * split + (ADAMW_BYTES["adamw_weights_copy_pass_params_per_s"] + ADAMW_BYTES[key]) * copies
            + ADAMW_BYTES[key] * disk_params)


def host_dram_term(plan: PlacementPlan, adamw: dict, ranks: int, split_sweep: bool = True,
                   grad_bytes: int = 2) -> float | None:
    """Seconds a step of the host DRAM's traffic: the host's AdamW streams its state
    (adamw_dram_bytes), the uploads' DMA reads the master (UPLOAD_READ_BYTES per uploaded
    parameter; `ranks` ranks sharing one host each read every unit from the one shared master),
    and the gradients' DMA writes `grad_bytes` per host-updated parameter (each unit once, by its
    owner); at the largest DRAM bandwidth the probes saw (probe_host_dram's a += b, or an AdamW
    pass's own traffic). None where probe_adamw measured no DRAM bandwidth.
    One rank too: on a 24 GiB GPU (Llama-3.1-8B clipped, every unit on the host) the AdamW
    passes' probed rates gave 1.9 s a step and the engine's took 2.3-2.4 s, the DMA's 8 B/param
    (uploads 6, gradients 2) beside their 36 on the same DRAM (NOTES.md "Floor probes")."""
    best = best_dram_gib_s(adamw)
    if not best:
        return None
    # (a BF16 master, --master bf16: the uploads read 2 B/param)
    nbytes = (ranks * plan.host_state.master_bytes * plan.upload_params() + grad_bytes * plan.host_updated_params
              + adamw_dram_bytes(plan, adamw, split_sweep))
    return nbytes / (best * 2**30)


def best_dram_gib_s(adamw: dict) -> float | None:
    """The largest host DRAM bandwidth the probes saw: probe_host_dram's a += b, or an AdamW pass's
    own traffic (ADAMW_BYTES at its probed rate). None where probe_adamw measured no DRAM bandwidth."""
    if not adamw.get("dram_gib_s"):
        return None
    return max([adamw["dram_gib_s"]] + [adamw[k] * b / 2**30 for k, b in adamw_bytes(_probed_state(adamw)).items()
                                        if adamw.get(k)])


def floor_terms(comp: dict, copy: dict, adamw: dict, plan: PlacementPlan | None = None,
                device_adamw: dict | None = None, disk: dict | None = None, split_sweep: bool = True,
                collective: dict | None = None, ranks: int = 1, grad_bytes: int | None = None,
                dp_weights: str = "upload") -> dict:
    """The floor's terms (seconds) for a placement plan (engine/placement.py; None: the design's,
    every unit on the host, a 3-slot window), from the probes' results.

    Only host-updated units (host and disk) cost host AdamW, D2H (BF16 gradients, 2 B/param)
    and uploads (BF16 weights). Uploads: resident host layers once a step; a window twice
    (forward and backward) except the slots still holding layers at the turn
    (PlacementPlan.uploads_per_step); host vocabulary units once.
    Disk units (with `disk`, probe_disk's result): their moments (and masters, where they live
    there) are read and written once a step (16 B/param through the disk, 24 with the master,
    at the probe's mixed rate): disk_s (disk_term). Unclipped, that I/O runs beside the whole step
    (the backward releases the disk units first, the next forward needs them last); clipped, see
    _clip_sweep_terms.
    Units updated on the GPU run their AdamW on the compute stream: with `device_adamw` (the
    probe_device_adamw rate) it is added to compute_s (~26 B/param at HBM speed; the engine's
    optimizer_device spans were 38 ms a step for a Qwen3-4B with every unit there).
    Clipped (the deferred schedule): clip_sweep_s and the two-pass adamw_s, _clip_sweep_terms.

    `ranks` data-parallel ranks on this host (docs/data_parallel.md), a rank's terms:
    - allreduce_s (with `collective`, bench.collective's probe at that rank count): every unit's
      gradient slot is all-reduced as its backward ends, 2 (N - 1) / N x its bytes (`grad_bytes`
      per parameter, default the probe's dtype: BF16 on the GPU) at the bus bandwidth probed nearest
      its size (bench.collective.allreduce_term). The engine issues it on the compute stream
      (SlideEngine._gradient_complete calls dist.all_reduce there and the unit's norm, D2H and the
      next layer's backward are queued behind it), so it adds to compute_s and to the clipped
      sweep's backward; it is also listed alone.
    - d2h_s: only a unit's owner copies its gradient down: the busiest rank's shard (largest_shard),
      over its own PCIe link. h2d_s is unchanged: every rank uploads every unit over its own link.
    - adamw_s is unchanged: each rank updates its shard, but the ranks share the host's cores and
      DRAM, so the host's AdamW a step is still every host parameter at the host's probed rate
      (a lower bound: each rank runs its shard on its share of the cores, and an uneven shard,
      e.g. the disk units all on rank 0, ends later). Units updated on the GPU: every rank
      updates its own copy, so device AdamW and the disk tier's I/O (rank 0's) stay per host.
    - host_dram_s: the N uploads of each unit all read the one shared master from the same DRAM,
      beside AdamW's traffic and the gradients' DMA (host_dram_term; one rank has the term too).
    - dp_weights="gather" (--tuning.dp_weights): a unit's owner alone uploads it and
      broadcasts it to the host's other GPUs: h2d_s is the busiest rank's share of the uploads,
      host_dram_s reads the master once, and gather_s (_gather_term) is beside the step.
    One rank gives exactly the one-rank terms."""
    plan = plan or plan_of_runtime(comp)
    host_params = plan.host_updated_params
    # each GPU updates its own copy of the device units and its share of the sharded layers
    device_params = plan.params("gpu") + sum(u.numel for u in plan.busiest_shard_units())
    disk_params = plan.params("disk")
    device_update_s = device_params / device_adamw["device_adamw_params_per_s"] if device_adamw and device_params \
        else 0.0
    gib = 2**30
    if collective is not None and collective.get("world_size") != ranks:
        raise ValueError(f"the collective probe ran on {collective.get('world_size')} ranks, the floor is for {ranks}")
    reduce_s = (allreduce_term([u.numel for u in plan.units], collective, grad_bytes)
                if ranks > 1 and collective is not None else 0.0)
    gathering = ranks > 1 and dp_weights == "gather"
    upload_share = largest_shard(plan, ranks) / host_params if gathering and host_params else 1.0
    terms = {
        "compute_s": comp["compute_s"] + device_update_s + reduce_s,
        "h2d_s": 2 * plan.upload_params() * upload_share / (copy["h2d_gib_s"] * gib),
        "d2h_s": 2 * largest_shard(plan, ranks) / (copy["d2h_gib_s"] * gib),
        "adamw_s": host_params / adamw["adamw_params_per_s"],
    }
    if reduce_s:
        terms["allreduce_s"] = reduce_s
    if gathering and collective is not None:
        terms["gather_s"] = _gather_term(plan, collective)
    dram_s = host_dram_term(plan, adamw, 1 if gathering else ranks, split_sweep)
    if dram_s:
        terms["host_dram_s"] = dram_s
    disk_io_s = disk_term(plan, disk) if disk_params and disk else 0.0
    if disk_io_s:
        terms["disk_s"] = disk_io_s
    if plan.schedule == "deferred" and host_params:
        _clip_sweep_terms(terms, plan, comp, adamw, split_sweep=split_sweep, reduce_s=reduce_s,
                          device_update_s=device_update_s, uploads=1 if gathering else ranks)
    return terms


def _gather_term(plan: PlacementPlan, collective: dict) -> float:
    """gather_s under dp_weights="gather": each upload's owner broadcasts it to the host's other GPUs
    on a stream of its own, every upload's bytes (BF16 weights) at the probed all-gather bus
    bandwidth ((N - 1) / N of them cross each GPU's NVLink); the busiest rank's share of the uploads
    is its share of the host-updated parameters (the owners are balanced by size)."""
    layer_uploads, _ = plan.uploads_per_step()
    layer = max((u.numel for u in plan.layers), default=0)
    # the sharded layers' owners broadcast them too (cast from their GPU masters; no upload)
    messages = [layer] * (layer_uploads + plan.shard_broadcasts_per_step()) \
        + [u.numel for u in (plan.units[0], plan.units[-1]) if u.host_updated]
    return sum(allgather_seconds(2 * n, collective) for n in messages)   # BF16 weights


def _clip_sweep_terms(terms: dict, plan: PlacementPlan, comp: dict, adamw: dict, *, split_sweep: bool,
                      reduce_s: float, device_update_s: float, uploads: int) -> None:
    """Set clip_sweep_s (and the two-pass adamw_s) of a clipped step in `terms`.

    Clipped (the deferred schedule): no update may start before the global norm is known, at
    the end of the backward, and the next step's last host layer cannot compute before its
    update; so a step is at least the head, every layer's recompute + backward, the embedding's
    backward, the device units' AdamW, the host's weights pass over its units (at the probed
    rate of that pass: it writes the weights only, the moments follow where nothing waits) and
    one layer's forward: clip_sweep_s. (The forward runs in the sweep's shadow; nothing else of
    the host's sweep can overlap.) The weights pass takes at least its bytes and the following
    `uploads`' master reads at the best DRAM rate the probes saw, where that is the longer. Units
    with an upload copy (clip_sweep=weights) take that pass at the probed rate of the BF16-writing
    pass (adamw_weights_copy_pass_params_per_s), their second pass being the whole update.
    Disk units: disk_s stands alone and is not added to clip_sweep_s: the step's reads and writes
    need the disk for at least disk_s a step whatever overlaps them, and how much of them must
    follow the norm is not modelled. (Until 2026-11-25 clip_sweep_s took the larger of the weights
    pass and the whole disk_s after the backward; both machines' clipped disk4 steps ran below
    that: 0.79x on the H100, 0.94x on the H200 with the fastest of 3 probe passes, NOTES.md
    "Disk tier".)"""
    gib = 2**30
    L = comp["num_layers"]
    host_params = plan.host_updated_params
    disk_params = plan.params("disk")
    ram_params = host_params - disk_params
    # the sweep writes the weights only (the moments follow under the next step): its rate
    # where probed, else the whole AdamW's; disk units: their I/O is disk_s, a term of its own
    sweep_rate = (adamw.get("adamw_weights_pass_params_per_s") if split_sweep else None) \
        or adamw["adamw_params_per_s"]
    # clip_sweep=weights: the units with an upload copy (the plan's) write BF16 weights first
    # (16 B/param, its probed rate), then the whole update (the moments pass's place)
    copy_params = plan.upload_copy_numel() if split_sweep else 0
    copy_rate = adamw.get("adamw_weights_copy_pass_params_per_s") or sweep_rate
    backward = L * comp["layer_recompute_backward_s"] + comp["head_s"] + comp["embed_s"]
    sweep_s = (ram_params - copy_params) / sweep_rate + copy_params / copy_rate
    best = best_dram_gib_s(adamw) if split_sweep else None
    if best:
        # The forward that follows the sweep uploads each swept unit as its update lands, so
        # the sweep shares the DRAM with those uploads' reads (the master, 4 B/param; an
        # upload copy, 2): the sweep takes at least all those bytes at the best DRAM rate.
        # Llama-3.1-8B b16 on a 24 GiB GPU: the weights pass ran at 6.94 G params/s in the
        # step against 8.11 alone, 142 GiB/s of DRAM with the uploads (NOTES.md "Floor probes").
        swept = ((adamw_bytes(plan.host_state)["adamw_weights_pass_params_per_s"]
                  + uploads * plan.host_state.master_bytes)
                 * (ram_params - copy_params)
                 + (ADAMW_BYTES["adamw_weights_copy_pass_params_per_s"] + uploads * 2) * copy_params)
        sweep_s = max(sweep_s, swept / (best * gib))
    # (the disk units' AdamW, whole, on the same host threads after the norm)
    terms["clip_sweep_s"] = (backward + reduce_s + device_update_s + sweep_s
                             + disk_params / adamw["adamw_params_per_s"] + comp["layer_forward_s"])
    if split_sweep and adamw.get("adamw_moments_pass_params_per_s"):
        # the host's AdamW a step is both passes (each reads the gradient and the moments)
        split_params = ram_params - copy_params
        terms["adamw_s"] = (split_params / sweep_rate + split_params / adamw["adamw_moments_pass_params_per_s"]
                            + copy_params / copy_rate + copy_params / adamw["adamw_params_per_s"]
                            + disk_params / adamw["adamw_params_per_s"])


def floor(model: str, batch: int, seq: int, num_layers: int | None = None, cache_units: int = 3,
          copy: dict | None = None, adamw: dict | None = None, head_impl: str = "chunked",
          head_chunk_tokens: int = 4096, compile_layers: bool = False, layer: str = "both") -> dict:
    """The design's floor (every unit on the host, a window of `cache_units` slots) with its
    probes; floor_terms() gives the terms of any other placement from the same probes.
    Beside it the hardware floor (hw_*): the same terms with the GPU's work priced at the rates
    probe_hardware measured instead of slidetune's own layer timed (hardware_compute; the slide
    engine recomputes every layer). layer: the decoder layer timed (probe_compute's)."""
    copy = copy or probe_copy()
    adamw = adamw or probe_adamw()
    comp = probe_compute(model, batch, seq, num_layers, head_impl, head_chunk_tokens, compile_layers, layer=layer)
    plan = plan_of_runtime(comp, {"cache_units": cache_units})
    terms = floor_terms(comp, copy, adamw, plan)
    bound = max(terms, key=terms.get)
    hardware = probe_hardware(load_model(model, num_layers=num_layers, with_tokenizer=False).split, batch, seq)
    hw_terms = floor_terms({**comp, **hardware_compute(hardware, range(comp["num_layers"]))}, copy, adamw, plan)
    hw_bound = max(hw_terms, key=hw_terms.get)
    return {"floor_s": terms[bound], "bound_by": bound, "terms": terms, "copy": copy, "adamw": adamw,
            "compute": comp, "device_adamw": probe_device_adamw(), "tokens_per_step": batch * seq,
            "hardware": hardware, "hw_floor_s": hw_terms[hw_bound], "hw_bound_by": hw_bound, "hw_terms": hw_terms}
