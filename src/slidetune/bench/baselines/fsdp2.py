"""Baseline: PyTorch FSDP2 with CPUOffloadPolicy on a one-rank process group.

What a user with one GPU and a model too large for it would pick from PyTorch itself:
`fully_shard` every decoder layer and the root, `CPUOffloadPolicy()` (sharded FP32 params,
gradients and the optimizer step on the host), `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`, activation checkpointing of every decoder layer (the same
recomputation as slide mode), and the same chunked cross-entropy head as slide mode so the
comparison is about the runtime, not the loss kernel. torch.optim.AdamW (foreach) steps
on the CPU-resident DTensors.

Run as a worker: `python -m slidetune.bench.baselines.fsdp2 SPEC.json OUT.json`.
On CPU (tests) the group uses gloo and no offload policy (there is nothing to offload to).
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..workload import BenchWorkload, WorkloadSpec


@dataclass
class FSDP2Spec(WorkloadSpec):
    name: str = "fsdp2"
    workload: BenchWorkload = field(default_factory=lambda: BenchWorkload("qwen3-4b", batch_size=8))
    recompute: bool = True
    head_chunk_tokens: int = 4096
    device: str = "auto"
    offload: bool = True


class _LossModel(nn.Module):
    """Root module: the HF model's base + the chunked CE head, so the root's FSDP hooks gather
    embedding, final norm and head weights around one forward."""

    def __init__(self, hf: nn.Module, chunk_tokens: int):
        super().__init__()
        self.hf = hf
        self.chunk_tokens = chunk_tokens

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from ...ops.cross_entropy import linear_cross_entropy
        h = self.hf.model(input_ids=ids, use_cache=False).last_hidden_state               # [B, S, d]
        w = self.hf.lm_head.weight                                                        # [V, d]
        return linear_cross_entropy(h.reshape(-1, h.shape[-1]), w.to(h.dtype), labels.reshape(-1),
                                    impl="chunked", chunk_tokens=self.chunk_tokens)


def build(spec: FSDP2Spec, dev: torch.device):
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM
    from ...models.presets import preset_config
    wl = spec.workload
    if not dist.is_initialized():
        store = tempfile.NamedTemporaryFile(prefix="slidetune-fsdp2-", delete=False).name
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"file://{store}",
                                rank=0, world_size=1)
    config = preset_config(wl.model, wl.num_layers)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    if spec.recompute:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = _LossModel(hf, spec.head_chunk_tokens)
    kw = {}
    if dev.type == "cuda":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if spec.offload:
            kw["offload_policy"] = CPUOffloadPolicy()
    for layer in hf.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    init_dev = "cpu" if (spec.offload or dev.type == "cpu") else dev
    model.to_empty(device=init_dev)
    g = torch.Generator(device="cpu").manual_seed(wl.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if "norm" in name:
                local.fill_(1.0)
            else:
                local.copy_(torch.randn(local.shape, generator=g) * 0.02)
        # rotary inv_freq is a buffer built on meta: recompute it on a real device
        rot = hf.model.rotary_emb
        fresh = type(rot)(config=config)
        for bname, buf in fresh.named_buffers():
            setattr(rot, bname, buf.to(dev))
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=wl.lr, weight_decay=0.1)
    return model, opt, params, config.vocab_size


def run_fsdp2(spec_dict: dict) -> dict:
    import torch.distributed as dist
    from ...telemetry.machine import machine_info, peak_rss_bytes
    from ..measure import synthetic_batches
    spec = FSDP2Spec.from_dict(spec_dict)
    wl = spec.workload
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if spec.device == "auto" else spec.device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
        if wl.gpu_memory_limit_gib:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, wl.gpu_memory_limit_gib * 2**30 / total), 0)
    offloaded = spec.offload and dev.type == "cuda"
    result: dict = {"spec": spec.to_dict(), "machine": machine_info(),
                    "system": "fsdp2-cpu-offload" if offloaded else f"fsdp2-{dev.type}"}
    model, opt, params, vocab = build(spec, dev)
    result["params"] = params
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    walls = []
    try:
        for k in range(wl.warmup + wl.steps):
            b = synthetic_batches(vocab, wl.batch_size, wl.seq_len, 1, wl.seed * 1000 + k)[0]
            ids, labels = b.input_ids.to(dev), b.labels.to(dev)
            if k == wl.warmup and dev.type == "cuda":
                sync()
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            loss = model(ids, labels) / b.num_target_tokens()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            walls.append(time.perf_counter() - t)
        measured = walls[wl.warmup:]
        result.update(step_s=walls, step_s_mean=statistics.mean(measured),
                      step_s_std=statistics.stdev(measured) if len(measured) > 1 else 0.0,
                      final_loss=float(loss.detach()) * b.num_target_tokens() / max(1, b.num_target_tokens()),
                      cpu_peak_rss_gib=peak_rss_bytes() / 2**30, status="ok")
        result["tokens_per_s"] = wl.batch_size * wl.seq_len / result["step_s_mean"]
        if dev.type == "cuda":
            result["gpu_peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
            result["gpu_peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return result


if __name__ == "__main__":
    import sys
    from .proc import worker_main
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    sys.exit(worker_main(run_fsdp2))
