"""The plain PyTorch reference of the numerical contract, independent of slidetune's engines.

A stock HF model with FP32 weights, its own forward, a token-summed cross-entropy over
the step's target tokens, torch.nn.utils.clip_grad_norm_ and torch.optim.AdamW with two
parameter groups (no decay for 1-D parameters).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from slidetune.models.load import LoadedModel
from slidetune.ops.sink_attention import reference_attention


def build_reference(loaded: LoadedModel) -> torch.nn.Module:
    config = copy.deepcopy(loaded.split.config)     # the model sets its attention on it: not the split's
    model = AutoModelForCausalLM.from_config(config, attn_implementation=reference_attention(config),
                                             dtype=torch.float32)
    state = {}
    for spec in loaded.split.units:
        flat = torch.empty(spec.numel)
        loaded.source.fill(spec, flat)
        for p in spec.params:
            state[p.full_name] = flat[p.offset:p.offset + p.numel].view(p.shape).clone()
        # the constant buffers (MoE routers' correction biases) from the source too, not HF's init
        state.update({b.full_name: t.detach().clone() for b, t in loaded.source.buffer_tensors(spec)})
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(k == "lm_head.weight" for k in missing), missing   # tied head
    if loaded.split.tied:
        model.tie_weights()
    return model.train()


class ReferenceTrainer:
    def __init__(self, model, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, max_grad_norm=None):
        self.model = model
        # no decay on norms and biases: the 1-D tensors, and biases of any shape (gpt-oss's experts'
        # [E, 2I] and [E, H] biases; HF's Trainer leaves every name with "bias" undecayed)
        named = list(model.named_parameters())
        decay = [p for n, p in named if p.dim() >= 2 and "bias" not in n.lower()]
        rest = [p for n, p in named if not (p.dim() >= 2 and "bias" not in n.lower())]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                      {"params": rest, "weight_decay": 0.0}],
                                     lr=lr, betas=betas, eps=eps, foreach=False)
        self.max_grad_norm = max_grad_norm

    def step(self, micro_batches, lr):
        n = sum(mb.num_target_tokens() for mb in micro_batches)
        total = 0.0
        self.opt.zero_grad(set_to_none=True)
        for mb in micro_batches:
            logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), mb.labels.flatten(), ignore_index=-100,
                                   reduction="sum")
            (loss / n).backward()
            total += float(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                              self.max_grad_norm if self.max_grad_norm else float("inf"))
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        return total / n, float(norm)
