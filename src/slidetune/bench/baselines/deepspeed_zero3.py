"""Baseline: DeepSpeed ZeRO-3 with CPU offload of parameters and optimizer (optional extra).

Same workload as the other rows: bf16 compute, activation checkpointing of every decoder
layer, the chunked CE head, DeepSpeedCPUAdam on the host. Only runs where `import deepspeed`
works and CUDA is present; otherwise `availability()` says why and the scenario reports it.
NOT YET VERIFIED on a GPU machine (deepspeed is not installed in the development venv).

Run as a worker: `python -m slidetune.bench.baselines.deepspeed_zero3 SPEC.json OUT.json`.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from .fsdp2 import FSDP2Spec, _LossModel


def availability() -> str | None:
    """None when runnable, else the reason ("not installed", "needs CUDA")."""
    try:
        import deepspeed  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means unavailable
        return "not installed"
    if not torch.cuda.is_available():
        return "needs CUDA"
    return None


def ds_config(spec: FSDP2Spec) -> dict:
    return {
        "train_micro_batch_size_per_gpu": spec.workload.batch_size,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True, "contiguous_gradients": True,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": spec.workload.lr, "weight_decay": 0.1}},
        "wall_clock_breakdown": False,
    }


def run_zero3(spec_dict: dict) -> dict:
    from ...telemetry.machine import machine_info
    why = availability()
    spec = FSDP2Spec.from_dict({**spec_dict, "name": spec_dict.get("name", "deepspeed-zero3")})
    wl = spec.workload
    if why:
        return {"spec": spec.to_dict(), "status": "unavailable", "error": why}
    import deepspeed
    from transformers import AutoModelForCausalLM
    from ...models.presets import preset_config
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    torch.cuda.set_device(0)
    if wl.gpu_memory_limit_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, wl.gpu_memory_limit_gib * 2**30 / total), 0)
    deepspeed.init_distributed()
    config = preset_config(wl.model, wl.num_layers)
    cfg = ds_config(spec)
    # With the DeepSpeed config registered, transformers builds the model under zero.Init
    # itself and still runs its weight init (std 0.02) on the gathered shards; a bare
    # zero.Init context would leave PyTorch's default init (embedding std 1.0), so the
    # losses would not match the other systems' workload.
    from transformers.integrations import HfDeepSpeedConfig
    hf_ds_config = HfDeepSpeedConfig(cfg)  # noqa: F841 - must stay alive until deepspeed.initialize
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    if spec.recompute:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = _LossModel(hf, spec.head_chunk_tokens)
    # The head weight is read outside lm_head's forward (chunked loss): tell ZeRO-3 to gather it.
    deepspeed.zero.register_external_parameter(model, hf.lm_head.weight)
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        return _measure(engine, model, config, spec, result_base={
            "spec": spec.to_dict(), "machine": machine_info(), "system": "deepspeed-zero3-cpu-offload",
            "params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())})
    finally:
        import deepspeed.comm as ds_comm
        ds_comm.destroy_process_group()


def _measure(engine, model, config, spec, result_base: dict) -> dict:
    from ...telemetry.machine import peak_rss_bytes
    from ..measure import synthetic_batches
    wl = spec.workload
    result = dict(result_base)
    walls = []
    for k in range(wl.warmup + wl.steps):
        b = synthetic_batches(config.vocab_size, wl.batch_size, wl.seq_len, 1, wl.seed * 1000 + k)[0]
        ids, labels = b.input_ids.cuda(), b.labels.cuda()
        if k == wl.warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        loss = engine(ids, labels) / b.num_target_tokens()
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
    measured = walls[wl.warmup:]
    result.update(step_s=walls, step_s_mean=statistics.mean(measured),
                  step_s_std=statistics.stdev(measured) if len(measured) > 1 else 0.0,
                  gpu_peak_alloc_gib=torch.cuda.max_memory_allocated() / 2**30,
                  gpu_peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
                  cpu_peak_rss_gib=peak_rss_bytes() / 2**30, status="ok")
    result["tokens_per_s"] = wl.batch_size * wl.seq_len / result["step_s_mean"]
    return result


if __name__ == "__main__":
    import sys
    from .proc import worker_main
    sys.exit(worker_main(run_zero3))
