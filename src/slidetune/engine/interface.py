"""`Engine`: what the trainer, the bench and the checkpoint code call on an engine (issue 49).

Two engines implement it: `PlainEngine` (gpu and ckpt modes: the whole model on the device) and
`SlideEngine` (slide mode: the host holds the state, layers slide through the GPU). The abstract
methods are the ones every engine has; the parts only the slide engine has are attributes and
methods here with the value a plain engine answers (no disk tier, no shared state, no timelines,
no asynchronous save, nothing to release), so a caller asks `engine.disk is not None` instead of
probing for an attribute.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterator

import torch

from .adamw import FP32_ADAMW, OptimizerState


class Engine(ABC):
    # what the host-updated units keep per parameter (--master, --moments); FP32 where none are
    host_state: OptimizerState = FP32_ADAMW
    # slide mode's parts, None where an engine has none: the disk tier (slide/disk_tier.DiskTier),
    # the host's shared state under data parallel (distributed.SharedHostState), what the other
    # ranks do while rank 0 saves (slide/save_service.SaveService), the host's span timeline
    # (telemetry/host_timeline.HostTimeline) and the GPU memory timeline (telemetry/memory_timeline)
    disk: Any = None
    shared: Any = None
    save_service: Any = None
    timeline: Any = None
    memory: Any = None
    # the placement as slide resolved it, for the reports: the decoder layers with a GPU slot of
    # their own and those updated on the GPU, the host AdamW's threads (None: nothing placed)
    resident_layers: int | None = None
    device_layers: int | None = None
    host_threads: int | None = None
    # the split model the engine trains (models/units.SplitModel); every engine sets it
    split: Any = None

    @abstractmethod
    def train_step(self, micro_batches: list, lr: float):
        """One optimizer step over the micro-batches (a StepResult)."""

    @torch.no_grad()
    def eval_loss(self, batch) -> tuple[float, int]:
        """(summed loss, target tokens) of one batch, no update: the sum of token_losses."""
        return float(self.token_losses(batch).sum()), batch.num_target_tokens()

    @abstractmethod
    def token_losses(self, batch) -> torch.Tensor:
        """[B * S] each position's loss with the current weights (0 where ignored), no update: a
        preference objective's reference pass (objectives/reference.py)."""

    @abstractmethod
    def next_token_logits(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, V] the logits after each row's last token (the evaluation's greedy samples)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Every update issued so far is done (a checkpoint or an evaluation reads the state next)."""

    @abstractmethod
    def named_master_params(self, on_host: bool = True) -> Iterator[tuple[str, Any]]:
        """(HF name, master weights) of every parameter."""

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, FP32 host tensor) of every constant buffer the units carry (models/buffers.py:
        MoE routers' correction biases): saved beside the weights, never updated."""
        return iter(()) if self.split is None else self.split.named_buffers()

    def load_buffers(self, tensors) -> None:
        """The constant buffers from a checkpoint's tensors (HF name -> tensor)."""
        if self.split is not None:
            self.split.set_buffers(tensors)

    @abstractmethod
    def optimizer_tensors(self, on_host: bool = True) -> dict[str, Any]:
        """Every unit's AdamW state by name."""

    @abstractmethod
    def load_state(self, masters: dict[str, torch.Tensor], optim: dict[str, torch.Tensor], step: int) -> None:
        """A checkpoint's weights and optimizer state, resumed at `step`."""

    @abstractmethod
    def memory_report(self) -> dict[str, int]:
        """Bytes by kind (GPU buffers, pinned, host state, ...), for the reports."""

    @abstractmethod
    def close(self) -> None:
        """Release what the engine holds (threads, files, memory)."""

    def async_save_refusal(self) -> str | None:
        """Why a checkpoint cannot be written while training goes on (None: it can)."""
        return ("the gpu/ckpt engines keep the whole state on the device and update all of it at once; "
                "their saves are blocking")

    def release_disk_tier(self) -> None:
        """Remove the disk tier's files once the run keeps no resumable state (none here)."""
