"""The constant buffers a decoder layer carries beside its parameters (issue 48).

Some MoE routers keep a score-correction bias as a persistent buffer (aux-loss-free balancing:
GLM-4.5's `e_score_correction_bias`, Zaya's `balancing_biases`; [n_experts] FP32 per layer).
transformers reads it in every forward and never changes it there (it is not a parameter, and no
training code of transformers updates it), so a faithful fine-tune uses the source's values in
every forward, never differentiates nor updates them, and writes them back unchanged.

A unit holds each such buffer as a `BufferSlot`: its names (local to the layer, and HF's state-dict
key), shape, and an FP32 host copy of its value. The weight sources fill the values (load.py); the
split merges device copies into the dict each `functional_call` of the layer gets, beside (never
among) the parameters a backward differentiates; the checkpoint writer saves them under their HF
names and a resume reads them back. They are tiny (n_experts floats a layer), so every layer's stay
on the device once made there (`DeviceBuffers`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class BufferSlot:
    """One constant buffer of a unit."""

    local_name: str          # relative to the unit's module (e.g. "mlp.gate.e_score_correction_bias")
    full_name: str           # HF's state-dict key (e.g. "model.layers.3.mlp.gate.e_score_correction_bias")
    shape: tuple[int, ...]
    value: torch.Tensor      # [shape] FP32 on the host: what every forward reads
    init: torch.Tensor | None  # [shape] FP32 transformers' own init (random weights), None: it has none
    keep_fp32: bool          # HF keeps it FP32 in a BF16/FP16 model (_keep_in_fp32_modules_strict)


def persistent_buffers(module: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(name under `module`, owning module, attribute) of each persistent buffer: what HF's
    state dict holds besides the parameters. Non-persistent ones (rotary tables) are left out."""
    out = []
    for owner_name, owner in module.named_modules():
        for attr, b in owner.named_buffers(recurse=False):
            if b is not None and attr not in owner._non_persistent_buffers_set:
                out.append((f"{owner_name}.{attr}" if owner_name else attr, owner, attr))
    return out


def non_persistent_buffers(module: nn.Module) -> list[str]:
    """Names of the buffers under `module` that HF's state dict does not hold."""
    return [f"{n}.{a}" if n else a for n, owner in module.named_modules()
            for a, b in owner.named_buffers(recurse=False)
            if b is not None and a in owner._non_persistent_buffers_set]


def unit_buffer_slots(model: nn.Module, module: nn.Module, full_names: dict[int, str]) -> list[BufferSlot]:
    """The persistent buffers of one unit's (meta) `module`, with transformers' init of each;
    `full_names` maps id(buffer) to its HF name in `model`."""
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    slots = []
    for local, owner, attr in persistent_buffers(module):
        b = owner._buffers[attr]
        full = full_names[id(b)]
        slots.append(BufferSlot(local, full, tuple(b.shape), torch.zeros(b.shape, dtype=torch.float32),
                                _hf_init(model, owner, attr), any(k in full for k in keep)))
    for s in slots:
        if s.init is not None:
            s.value.copy_(s.init)
    return slots


def _hf_init(model: nn.Module, owner: nn.Module, attr: str) -> torch.Tensor | None:
    """The value transformers' `_init_weights` gives the buffer: run on `owner` with that buffer
    swapped for a host tensor of NaN (the owner's parameters stay on meta, where an init is a
    no-op, so a router or an MoE block costs nothing here). None where the init leaves it unset (a
    value fixed by the module's constructor, lost on meta)."""
    meta = owner._buffers[attr]
    probe = torch.full(meta.shape, float("nan"), dtype=torch.float32)
    owner._buffers[attr] = probe
    try:
        with torch.no_grad():
            model._init_weights(owner)
    finally:
        owner._buffers[attr] = meta
    return None if bool(probe.isnan().any()) else probe


class DeviceBuffers:
    """Each layer's buffers as the forward reads them: on the layer's device, in the dtype HF's
    model holds them (FP32 where HF keeps them so, else the compute dtype), made once and kept
    (constant during training); `forget()` after the host values change (a resume)."""

    def __init__(self, slots: list[list[BufferSlot]]):
        self.slots = slots                  # per layer
        self._cache: dict[tuple, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()       # the slide engine's threads run layers concurrently

    def of(self, i: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Layer i's buffers by local name (empty for a layer without any)."""
        if not self.slots[i]:
            return {}
        key = (i, torch.device(device), dtype)
        with self._lock:
            if key not in self._cache:
                made = {s.local_name: s.value.to(device=device, dtype=torch.float32 if s.keep_fp32 else dtype)
                        for s in self.slots[i]}
                if made and next(iter(made.values())).is_cuda:
                    # made on this thread's stream, read on others (the pipeline's): finished first
                    torch.cuda.current_stream(device).synchronize()
                self._cache[key] = made
            return self._cache[key]

    def forget(self) -> None:
        with self._lock:
            self._cache.clear()
