"""One device helper, so the same scheduling code runs on CUDA and on the CPU.

On CUDA, streams and events are real and host buffers are pinned. On the CPU
(the unit tests) every stream is the "current stream", events are already
complete, copies are synchronous and pinning is a no-op: the pipeline's
dependency logic is exercised, only without asynchrony.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


class _NullEvent:
    """Stands in for torch.cuda.Event on the CPU: always complete."""

    def record(self, stream=None) -> None:
        pass

    def register_host(self, t: torch.Tensor) -> None:
        """Page-lock an existing host tensor in place (cudaHostRegister): async copies, no extra RAM."""
        if not self.is_cuda or t.numel() == 0:
            return
        err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {t.numel() * t.element_size() / 2**30:.2f} GiB failed "
                               f"(cudaError {err}); the host may limit locked memory (ulimit -l). "
                               f"Use --cast-on cpu to stream through small pinned buffers instead")

    def unregister_host(self, t: torch.Tensor) -> None:
        if self.is_cuda and t.numel():
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())

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

    def register_host(self, t: torch.Tensor) -> None:
        """Page-lock an existing host tensor in place (cudaHostRegister): async copies, no extra RAM."""
        if not self.is_cuda or t.numel() == 0:
            return
        err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {t.numel() * t.element_size() / 2**30:.2f} GiB failed "
                               f"(cudaError {err}); the host may limit locked memory (ulimit -l). "
                               f"Use --cast-on cpu to stream through small pinned buffers instead")

    def unregister_host(self, t: torch.Tensor) -> None:
        if self.is_cuda and t.numel():
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return event or _NullEvent()


@dataclass
class Device:
    """Wraps a torch.device with stream/event/pinning helpers."""

    device: torch.device

    @staticmethod
    def resolve(name: str | None = None) -> "Device":
        if name in (None, "auto"):
            name = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(name)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but torch.cuda.is_available() is False")
        return Device(dev)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def new_stream(self):
        return torch.cuda.Stream(self.device) if self.is_cuda else _NullStream()

    def current_stream(self):
        return torch.cuda.current_stream(self.device) if self.is_cuda else _NullStream()

    def event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing) if self.is_cuda else _NullEvent()

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
        return torch.empty(numel, dtype=dtype, pin_memory=self.is_cuda)

    def register_host(self, t: torch.Tensor) -> None:
        """Page-lock an existing host tensor in place (cudaHostRegister): async copies, no extra RAM."""
        if not self.is_cuda or t.numel() == 0:
            return
        err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {t.numel() * t.element_size() / 2**30:.2f} GiB failed "
                               f"(cudaError {err}); the host may limit locked memory (ulimit -l). "
                               f"Use --cast-on cpu to stream through small pinned buffers instead")

    def unregister_host(self, t: torch.Tensor) -> None:
        if self.is_cuda and t.numel():
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.is_cuda else 0

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.is_cuda else 0

    def max_memory_reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device) if self.is_cuda else 0

    def reset_peak(self) -> None:
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def free_and_total(self) -> tuple[int, int]:
        if self.is_cuda:
            return torch.cuda.mem_get_info(self.device)
        return (0, 0)
