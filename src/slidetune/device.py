"""One device helper, so the same scheduling code runs on CUDA and on the CPU.

On CUDA, streams and events are real and host buffers are pinned. On the CPU
(the unit tests) every stream is the "current stream", events are already
complete, copies are synchronous and pinning is a no-op: the pipeline's
dependency logic is exercised, only without asynchrony.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

CU_CTX_SCHED_BLOCKING_SYNC = 0x04       # cuda.h: host threads sleep on a wait instead of spinning
CU_CTX_SCHED_MASK = 0x07


def request_blocking_sync(index: int) -> str:
    """Ask the driver to make every host wait on this GPU sleep instead of spin; says what happened.

    CUDA's default (auto scheduling with fewer contexts than cores) spins a core in every
    synchronizing call: `.item()`, `torch.cuda.synchronize`, waits on non-blocking events.
    The slide engine's host runs AdamW on all cores in parallel regions that finish with
    their slowest thread, so one spinning waiter cost 41% of AdamW's rate on the H100 host
    (benchmarks/scripts/host_contention.py, NOTES.md "Pipeline threads"). Sets the primary context's
    scheduling flag through the driver API (torch does not expose it); it must run before
    the context is created to be certain to apply, so Device.resolve calls it first.
    """
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return f"spin (libcuda not loadable: {e})"
    dev = ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), index) != 0:
        return "spin (cuInit/cuDeviceGet failed)"
    err = cuda.cuDevicePrimaryCtxSetFlags_v2(dev, CU_CTX_SCHED_BLOCKING_SYNC)
    flags, active = ctypes.c_uint(), ctypes.c_int()
    cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active))
    if (flags.value & CU_CTX_SCHED_MASK) == CU_CTX_SCHED_BLOCKING_SYNC:
        return "blocking_sync"
    return f"spin (cuDevicePrimaryCtxSetFlags returned {err}; context active: {bool(active.value)})"


# /proc/cpuinfo flags of a CPU that computes bf16 matmuls natively: AVX512-BF16 (Cooper Lake, Zen 4
# and later) or AMX-BF16 (Sapphire Rapids and later). Without them torch emulates bf16 through fp32
# conversions: a 2-core AVX2-only EPYC ran the default job's bf16 matmuls at 1.2 GFLOP/s against 55 in
# fp32 (220-251 s a step against 15-25 s), where a CPU with them runs bf16 faster than fp32.
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
CPUINFO = Path("/proc/cpuinfo")
# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) below its first bf16 one, AVX512_CORE_BF16: under such a cap
# oneDNN leaves the CPU's bf16 instructions unused, as on a CPU without them
_ONEDNN_ISAS_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def cpu_flags(cpuinfo: Path | None = None) -> set[str] | None:
    """The CPU's feature flags as /proc/cpuinfo lists them (Linux; the first processor's line);
    elsewhere torch's own query (torch.cpu.get_capabilities, from cpuinfo), or None if neither answers."""
    cpuinfo = cpuinfo or CPUINFO
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):       # x86 | ARM
                return set(value.split())
    except OSError:
        pass
    get = getattr(torch.cpu, "get_capabilities", None)
    if get is None:
        return None
    try:
        return {name for name, v in get().items() if v is True}
    except Exception:  # noqa: BLE001 - a private query; no answer means "unknown"
        return None


def cpu_bf16(flags: set[str] | None) -> tuple[bool, str]:
    """(whether this CPU computes bf16 natively, why), from its flags (cpu_flags)."""
    if flags is None:
        return False, "the CPU's features are unknown"
    have = [f for f in CPU_BF16_FLAGS if f in flags]
    if not have:
        return False, "this CPU has no bf16 instructions (no AMX-BF16 or AVX512-BF16: bf16 would be emulated, " \
                      "many times slower than fp32)"
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if cap in _ONEDNN_ISAS_WITHOUT_BF16:
        return False, f"ONEDNN_MAX_CPU_ISA={cap} keeps oneDNN off the CPU's bf16 instructions ({', '.join(have)})"
    return True, f"this CPU computes bf16 natively ({', '.join(have)})"


def resolve_dtype(dtype: str, device_type: str, cpuinfo: Path | None = None) -> tuple[str, str]:
    """The compute dtype `dtype` means on a device of `device_type` (cpu | cuda), and why.

    auto: bf16 where the device computes it natively (a CUDA GPU with bf16; a CPU with AMX-BF16 or
    AVX512-BF16), fp32 elsewhere. Any other value is itself ("as asked")."""
    if dtype != "auto":
        return dtype, "as asked (--dtype)"
    if device_type == "cuda":
        if not torch.cuda.is_available():     # a GPU described, not here (slidetune plan --device cuda)
            return "bf16", "a GPU is taken to compute bf16 natively (Ampere or newer)"
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "bf16", "the GPU computes bf16 natively"
        return "fp32", "the GPU has no native bf16 (before Ampere)"
    native, why = cpu_bf16(cpu_flags(cpuinfo))
    return ("bf16" if native else "fp32"), why


class _PinnedCounter:
    """Bytes of host memory the engine holds page-locked, live (a soak's leak detector, bench/soak):
    the async-copy buffers of `Device.host_empty` and the disk tier (counted from allocation until
    their storage is freed; on a CPU-only machine the same buffers, which are plain there) plus the
    host tensors page-locked in place by `Device.register_host` (CUDA only)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.current = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.current += nbytes

    def track(self, t: torch.Tensor) -> torch.Tensor:
        """Count `t`'s storage until it is freed (the last view of it gone); returns `t`."""
        storage = t.untyped_storage()
        self.add(storage.nbytes())
        weakref.finalize(storage, self.add, -storage.nbytes())
        return t


PINNED = _PinnedCounter()


def pinned_bytes() -> int:
    """Page-locked host bytes the engine holds now (see _PinnedCounter)."""
    return PINNED.current


def cuda_host_cache_bytes() -> int:
    """Bytes of torch's CUDA caching host allocator, its blocks in use or cached (pin_memory()
    anywhere, the engine's Device.host_empty among them); 0 before CUDA is initialized."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


class _NullEvent:
    """Stands in for torch.cuda.Event on the CPU: always complete."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: "_NullEvent") -> float:
        return 0.0


class _NullStream:
    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return event or _NullEvent()


def use_expandable_segments() -> bool:
    """Have the caching allocator grow segments in place (expandable_segments), unless
    PYTORCH_CUDA_ALLOC_CONF says otherwise. A slide step allocates the same working sets layer after
    layer, at sizes that change between forward, recompute, the MLP tiles and the head: with fixed
    segments the reserved peak ran 26% above the allocated one (Qwen3-8B b32 under a 24 GiB budget,
    15.2 allocated, 19.1 reserved; NOTES.md "Memory fit margins"), memory the fit check has to leave free. Takes
    effect for segments allocated after the call; returns whether it was set here."""
    if "expandable_segments" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return False
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        return False
    setter("expandable_segments:True")
    return True


@dataclass
class Device:
    """Wraps a torch.device with stream/event/pinning helpers."""

    device: torch.device
    # Events whose synchronize() sleeps (cudaEventBlockingSync) rather than spins a core
    # the host's AdamW needs; "spin" keeps CUDA's default for A/B measurements.
    waits: str = "block"
    # What the driver granted for the context's other waits (.item(), synchronize()).
    context_waits: str = "n/a"

    @staticmethod
    def resolve(name: str | None = None, waits: str = "block") -> "Device":
        """name: auto | cpu | cuda[:i]; waits: block | spin (how host threads wait on the GPU)."""
        if waits not in ("block", "spin"):
            raise ValueError(f"waits must be block or spin, not {waits!r}")
        if name in (None, "auto"):
            name = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(name)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but torch.cuda.is_available() is False")
        context_waits = "n/a"
        if dev.type == "cuda":
            # before anything creates the context (current_device() may)
            context_waits = request_blocking_sync(dev.index or 0) if waits == "block" else "spin"
            use_expandable_segments()
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        return Device(dev, waits=waits, context_waits=context_waits)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def new_stream(self):
        return torch.cuda.Stream(self.device) if self.is_cuda else _NullStream()

    def current_stream(self):
        return torch.cuda.current_stream(self.device) if self.is_cuda else _NullStream()

    def event(self, timing: bool = False):
        if not self.is_cuda:
            return _NullEvent()
        return torch.cuda.Event(enable_timing=timing, blocking=self.waits == "block")

    def record(self, stream=None, timing: bool = False):
        """A new event recorded now on `stream` (default: current stream)."""
        ev = self.event(timing)
        if self.is_cuda:
            ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return ev

    def stream_ctx(self, stream):
        if self.is_cuda:
            return torch.cuda.stream(stream)
        return contextlib.nullcontext()

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for async copies: pinned on CUDA machines, plain on CPU-only ones."""
        return PINNED.track(torch.empty(numel, dtype=dtype, pin_memory=self.is_cuda))

    def register_host(self, t: torch.Tensor) -> None:
        """Page-lock an existing host tensor in place (cudaHostRegister): async copies, no extra RAM."""
        if not self.is_cuda or t.numel() == 0:
            return
        err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {t.numel() * t.element_size() / 2**30:.2f} GiB failed "
                               f"(cudaError {err}); the host may limit locked memory (ulimit -l). "
                               f"Use --tuning.cast_on cpu to stream through small pinned buffers instead")
        PINNED.add(t.numel() * t.element_size())

    def unregister_host(self, t: torch.Tensor) -> None:
        if self.is_cuda and t.numel():
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
            PINNED.add(-t.numel() * t.element_size())

    def limit_memory(self, gib: float) -> int:
        """Cap what this process may allocate on the GPU at `gib` GiB (the caching allocator raises
        torch.OutOfMemoryError past it, as on a smaller card); returns the cap in bytes (no-op on the CPU)."""
        limit = int(gib * 2**30)
        if self.is_cuda:
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), self.device)
        return limit

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.is_cuda else 0

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.is_cuda else 0

    def max_memory_reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device) if self.is_cuda else 0

    def allocator_counters(self) -> dict[str, int]:
        """Cumulative caching-allocator events (no GPU sync): cudaMalloc calls, cudaFree calls and
        retries (a failed cudaMalloc that freed the cache and tried again: a stall of milliseconds
        to seconds). Empty on the CPU."""
        if not self.is_cuda:
            return {}
        stats = torch.cuda.memory_stats(self.device)
        return {k: int(stats.get(k, 0)) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}

    def reset_peak(self) -> None:
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def free_and_total(self) -> tuple[int, int]:
        if self.is_cuda:
            return torch.cuda.mem_get_info(self.device)
        return (0, 0)
