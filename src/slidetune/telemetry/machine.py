"""The machine's details, written into every result file."""
from __future__ import annotations

import os
import platform
import subprocess

import psutil
import torch


def machine_info() -> dict:
    info = {
        "hostname": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cpu": _cpu_model(),
        "cpu_cores_logical": os.cpu_count(),
        "cpu_cores_physical": psutil.cpu_count(logical=False),
        "ram_total_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), gpu_sms=p.multi_processor_count,
                    gpu_count=torch.cuda.device_count(), driver=_driver())
    else:
        info["gpu"] = None
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        # one line per GPU (the same driver on all of a host's GPUs): the first
        lines = out.stdout.strip().splitlines()
        return lines[0].strip() if lines else None
    except (OSError, subprocess.SubprocessError):
        return None


def peak_rss_bytes() -> int:
    """The process's peak resident set (VmHWM), not just the current RSS."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return psutil.Process().memory_info().rss


def _kib_fields(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    """Bytes of the `Key:   N kB` lines of a /proc file (missing keys: absent)."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in keys:
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def memory_parts() -> dict[str, int]:
    """This process's peak RSS and its shared parts, bytes: VmHWM (peak RSS), RssShmem (resident pages
    of shared memory: /dev/shm mappings such as data parallel's host state, engine/distributed.py)
    RssFile (resident pages of mapped files: the shared libraries, one page-cache copy whatever
    the number of processes) and Pss (each shared page divided among the processes that map it;
    smaps_rollup, Linux >= 4.14). Zeros where /proc is not there."""
    status = _kib_fields("/proc/self/status", ("VmHWM", "RssShmem", "RssFile"))
    rollup = _kib_fields("/proc/self/smaps_rollup", ("Pss",))
    return {"peak_rss": status.get("VmHWM", 0), "rss_shmem": status.get("RssShmem", 0),
            "rss_file": status.get("RssFile", 0), "pss": rollup.get("Pss", 0)}


def host_memory_snapshot() -> dict[str, int]:
    """Where this process's host memory is now, bytes: its resident set split by kind (RssAnon:
    private heap and page-locked buffers; RssFile: pages of mapped files, the shared libraries
    among them, one physical copy however many processes map them; RssShmem: /dev/shm mappings such
    as data parallel's host state), the peak so far (VmHWM), what the engine holds page-locked
    (device.PINNED) and what torch's CUDA caching host allocator holds (pin_memory() outside the
    engine). Taken at a run's start, after its build and after its steps (bench.measure), so a
    rank's fixed cost (CUDA context, libraries, communicators) reads apart from its share of the
    state. Zeros where /proc is not there."""
    from ..device import cuda_host_cache_bytes, pinned_bytes
    status = _kib_fields("/proc/self/status", ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"))
    out = {"rss": status.get("VmRSS", 0), "peak_rss": status.get("VmHWM", 0), "rss_anon": status.get("RssAnon", 0),
           "rss_file": status.get("RssFile", 0), "rss_shmem": status.get("RssShmem", 0),
           "engine_pinned": pinned_bytes(), "cuda_host_cache": cuda_host_cache_bytes()}
    return out


class HostRss:
    """The current RSS of one host's ranks together, the shared host state (its /dev/shm file,
    `shared_bytes`) counted once: what `slidetune train --gpus N` logs as cpu_rss_gib. One rank
    (no other pids): this process's RSS. The ranks' pids are gathered once at start; reading their
    /proc/<pid>/status needs no collective per step (the same user runs every rank)."""

    def __init__(self, pids: list[int] | None = None, shared_bytes: int = 0):
        self.pids, self.shared_bytes = list(pids or []), shared_bytes

    def bytes(self) -> int:
        if len(self.pids) < 2:
            return psutil.Process().memory_info().rss
        parts = [_kib_fields(f"/proc/{pid}/status", ("VmRSS", "RssShmem", "RssFile")) for pid in self.pids]
        parts = [{"peak_rss": p.get("VmRSS", 0), "rss_shmem": p.get("RssShmem", 0), "rss_file": p.get("RssFile", 0)}
                 for p in parts]
        return host_peak_rss(parts, self.shared_bytes)


def _file_bytes(part: dict) -> int:
    """A rank's resident file pages: its own record, or (runs of 2026-11-26 that recorded them only
    there) its last host-memory snapshot (bench.measure's host_memory)."""
    if "rss_file" in part:
        return part["rss_file"]
    return (part.get("host_memory") or {}).get("stepped", {}).get("rss_file", 0)


def host_peak_rss(parts: list[dict[str, int]], shared_bytes: int = 0) -> int:
    """The peak RSS of the ranks of one host together, counting their shared memory once: each rank's
    peak less its resident shared pages, plus the shared state's whole size (`shared_bytes`: the
    /dev/shm file, reserved in full with posix_fallocate, so every page of it is host memory) or,
    where larger, the most shared pages one rank has resident. Each rank touches only part of the
    file (its shard's moments, the masters it uploads), so the largest rank's shared pages alone
    undercount it: on 2x H100 with Qwen3-8B that read 63.5 GiB for a host using 82.1.
    Mapped files' pages (RssFile: torch's and CUDA's libraries, ~0.5 GiB a rank) are one page-cache
    copy however many ranks map them: counted once, as the largest rank's (every rank maps the
    same libraries).
    An upper bound where the ranks' private peaks fall at different moments (memory_parts)."""
    if not parts:
        return 0
    files = [_file_bytes(p) for p in parts]
    return (sum(p["peak_rss"] - p["rss_shmem"] - f for p, f in zip(parts, files)) + max(files)
            + max(shared_bytes, max(p["rss_shmem"] for p in parts)))
