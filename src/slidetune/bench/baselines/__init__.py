"""What a user would pick instead of slide mode, and the plain helpers the techniques and
throughput scenarios share.

  proc       run one worker module per configuration in its own process; OOM parsing
  hf_train   a plain PyTorch training loop over an unchanged HF model with one memory
             technique applied (precision, attention kernel, local window, recompute, head)
  fsdp2      PyTorch FSDP2 (fully_shard + CPUOffloadPolicy) on a one-rank process group
  deepspeed_zero3  DeepSpeed ZeRO-3 with CPU offload (optional: only when deepspeed imports)
"""
