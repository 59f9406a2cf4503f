"""gpu and ckpt modes: the whole model on one device, the same numerical contract as slide.

Per unit: FP32 master + AdamW moments + an FP32 gradient accumulator, and a copy of
the weights in the compute dtype that forward/backward use. After the last
micro-batch the gradients (reduced in FP32) are clipped by the global norm and the
fused AdamW kernel updates the master, which is then cast back into the compute copy.
ckpt mode wraps the selected decoder layers in non-reentrant activation checkpointing.
"""
from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from ..device import Device
from ..faults import maybe_oom, maybe_poison
from ..models.load import LoadedModel, fill_on_device
from ..objectives.head import head_step, step_loss, step_metrics
from ..objectives.preference import PreferenceConfig
from ..telemetry.events import EventTimer
from ..telemetry.host_timeline import HostTimeline
from ..telemetry.memory_timeline import MemoryTimeline
from .adamw import FP32_ADAMW, AdamWConfig, FlatAdamW
from .config import RuntimeConfig
from .gc_policy import GCFreeze
from .interface import Engine
from .result import StepResult
from .slide.transfer import clip_coefficient


class _DeviceUnit:
    def __init__(self, spec, source, optim: AdamWConfig, dtype: torch.dtype, device: torch.device):
        self.spec = spec
        self.master = fill_on_device(source, spec, device)             # [numel] fp32
        self.opt = FlatAdamW(self.master, spec.n_decay, optim)
        self.grad = torch.zeros_like(self.master)                      # [numel] fp32
        self.compute = self.master.to(dtype)                           # [numel] compute dtype
        if self.compute.data_ptr() == self.master.data_ptr():
            self.compute = self.master.clone()
        self.leaves = {k: v.requires_grad_(True) for k, v in spec.views(self.compute).items()}


class PlainEngine(Engine):
    host_state = FP32_ADAMW      # --master / --moments are slide mode's (RuntimeConfig refuses them here)

    def __init__(self, loaded: LoadedModel, rt: RuntimeConfig, optim: AdamWConfig, device: Device,
                 grad_accum: int = 1, max_grad_norm: float | None = None, timer: EventTimer | None = None,
                 objective: PreferenceConfig | None = None):
        self.split = loaded.split
        self.objective = objective         # a preference objective's head (objectives/head.py); None: SFT
        self.rt = rt
        self.device = device
        self.dtype = rt.torch_dtype
        self.max_grad_norm = max_grad_norm
        self.timer = timer or EventTimer(device, enabled=False)
        self.memory = MemoryTimeline(device, enabled=False)
        # no host threads here; present so the bench intersects the timer's spans with the step
        # (GPU idle = step wall time minus the union of compute spans)
        self.timeline = HostTimeline(enabled=False)
        L = self.split.num_layers
        self.recompute = rt.recomputed_layers(L)
        self.units = [_DeviceUnit(s, loaded.source, optim, self.dtype, device.device) for s in self.split.units]
        self.step_index = 0
        self.gc_freeze = GCFreeze(rt.host.gc_freeze)
        self._in_backward = False                  # set around backward (recompute attribution)
        self._grad_marks: dict = {}                # layer -> timer mark when its input's gradient lands
        self._recompute_marks: dict = {}           # layer -> (start, end) marks of its recompute

    def _loss(self, mb) -> torch.Tensor:
        """The micro-batch's summed token loss, through autograd."""
        x, labels = self._hidden(mb)
        tied = self.units[0].leaves["weight"] if self.split.tied else None
        with self.timer.span("head", -1):
            return self.split.head_loss(self.units[-1].leaves, x, labels, lm_weight=tied,
                                        impl=self.rt.resolved_head_impl, chunk_tokens=self.rt.head.head_chunk_tokens)

    def _hidden(self, mb) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's output [B, S, d] in autograd's graph, the labels [B, S] on the device)."""
        split, dev = self.split, self.device.device
        ids = mb.input_ids.to(dev)
        labels = mb.labels.to(dev)
        mask = mb.attention_mask.to(dev) if mb.attention_mask is not None else None
        # packing "masked": positions restarting per document; the mask follows from them
        positions = mb.position_ids.to(dev) if getattr(mb, "position_ids", None) is not None else None
        kwargs = split.layer_kwargs(*ids.shape, self.dtype, dev, attention_mask=mask, position_ids=positions)
        timing = self.timer.enabled and torch.is_grad_enabled()
        with self.timer.span("embed", -1):
            x = split.embed_forward(self.units[0].leaves, ids)           # [B, S, d]
            split.attach_sides(kwargs, self.units[0].leaves, ids, x)    # Gemma 4 E2B / E4B (models/layer_sides.py)
        self.memory.mark("embed")
        for i in range(split.num_layers):
            params = self.units[i + 1].leaves
            if self.memory.enabled and torch.is_grad_enabled():
                # fires when the gradient reaches layer i's input: the end of its backward
                x.register_hook(lambda g, i=i: self.memory.mark("backward", i))
            if timing and x.requires_grad:
                # gradient at layer i's input: end of layer i's backward (start of layer i-1's)
                x.register_hook(lambda g, i=i: self._grad_mark(i))
            with self.timer.span("forward", i):
                if i in self.recompute:
                    x = checkpoint(self._checkpointed_layer, i, params, x, kwargs[i], use_reentrant=False)
                else:
                    x = split.layer_forward(i, params, x, kwargs[i])
            self.memory.mark("forward", i)
        if timing and x.requires_grad:
            # gradient at the last layer's output: end of the head's backward
            x.register_hook(lambda g: self._grad_mark(split.num_layers))
        return x, labels

    # ------------------------------------------------------------ timing hooks
    # Recompute attribution (docs/contract.md): a checkpointed layer's function runs twice,
    # once in forward (inside the "forward" span) and once when backward unpacks its saved
    # tensors. The second run is timed as "recompute" for that layer, and the layer's
    # "backward" spans are the window between the gradient arriving at its output and
    # leaving its input, with the recompute interval cut out of it.
    def _checkpointed_layer(self, i: int, params, x, kw):
        if not self._in_backward or not self.timer.enabled:
            return self.split.layer_forward(i, params, x, kw)
        start = self.timer.mark("recompute", i)
        try:          # non-reentrant checkpoint may stop the recompute early by raising
            return self.split.layer_forward(i, params, x, kw)
        finally:
            self._recompute_marks[i] = (start, self.timer.mark("recompute", i))

    def _grad_mark(self, i: int) -> None:
        self._grad_marks[i] = self.timer.mark("backward", i)

    def _backward_spans(self, start, end) -> None:
        """Turn the marks of one backward pass into spans: head_backward, per-layer
        backward (minus recompute), recompute, embed_backward."""
        L = self.split.num_layers
        g, rc = self._grad_marks, self._recompute_marks
        if L not in g or any(i not in g for i in range(L)):
            self.timer.add("backward", -1, start, end)      # hooks did not fire: one span
        else:
            self.timer.add("head_backward", -1, start, g[L])
            for i in reversed(range(L)):
                if i in rc:
                    r0, r1 = rc[i]
                    self.timer.add("backward", i, g[i + 1], r0)
                    self.timer.add("recompute", i, r0, r1)
                    self.timer.add("backward", i, r1, g[i])
                else:
                    self.timer.add("backward", i, g[i + 1], g[i])
            self.timer.add("embed_backward", -1, g[0], end)
        self._grad_marks, self._recompute_marks = {}, {}

    def train_step(self, micro_batches: list, lr: float) -> StepResult:
        n_tokens = sum(mb.num_target_tokens() for mb in micro_batches)
        if n_tokens == 0:
            raise ValueError("the step's batches contain no target tokens (all labels are -100)")
        total = torch.zeros((), dtype=torch.float32, device=self.device.device)
        stats = []
        for m, mb in enumerate(micro_batches):
            if self.objective is None:
                loss = maybe_poison(self._loss(mb), self.step_index + 1)     # tests only (faults.py)
                backward = lambda: (loss / n_tokens).backward()              # noqa: E731
            else:
                loss, backward, pairs = self._preference_head(mb)
                stats.append(pairs)
            maybe_oom(self.step_index + 1)
            self.memory.mark("head")
            bw_start = self.timer.mark("backward", -1)
            self._in_backward = True
            try:
                backward()
            finally:
                self._in_backward = False
            self._backward_spans(bw_start, self.timer.mark("backward", -1))
            self.memory.mark("backward_end")
            total += loss.detach().float()
            with self.timer.span("grad_copy", -1):
                self._accumulate_grads(m)
        with self.timer.span("optimizer", -1):
            sq = torch.stack([torch.linalg.vector_norm(u.grad) for u in self.units]).square().sum()
            norm = math.sqrt(float(sq))
            coef = clip_coefficient(norm, self.max_grad_norm)
            for k, u in enumerate(self.units):
                # per-unit update spans: decoder layer k-1; embed and head as "optimizer_other"
                layer = k - 1 if u.spec.kind == "layer" else -1
                with self.timer.span("optimizer_unit" if layer >= 0 else "optimizer_other", layer):
                    u.opt.begin_step()
                    u.opt.update(u.grad, lr, 0, grad_scale=coef)
                    with torch.no_grad():
                        u.compute.copy_(u.master)
        self.memory.mark("optimizer")
        self.step_index += 1
        self.gc_freeze.freeze()        # everything the run keeps exists by now (engine/gc_policy.py)
        return StepResult(loss=step_loss(self.objective, float(total), n_tokens), n_tokens=n_tokens,
                          grad_norm_value=norm, metrics=step_metrics(self.objective, stats))

    def _preference_head(self, mb):
        """A preference objective's micro-batch: the layers through autograd, the head's two passes
        without it (objectives/head.py, as the slide engine's head), then (the returned closure)
        the layers' backward from the hidden state's gradient and the head's gradients set on its
        leaves (a tied weight's added to the embedding's). Returns (loss, backward, the pairs' stats)."""
        x, labels = self._hidden(mb)
        head = {k: v.detach() for k, v in self.units[-1].leaves.items()}
        embed = self.units[0].leaves
        tied = embed["weight"].detach() if self.split.tied else None
        pairs = mb.pairs.to(self.device.device) if mb.pairs is not None else None
        with self.timer.span("head", -1):
            res = head_step(self.split, head, x.detach(), labels, pairs, self.objective, 1.0, tied,
                            self.rt.resolved_head_impl, self.rt.head.head_chunk_tokens)

        def backward() -> None:
            x.backward(res.g_hidden)
            for name, leaf in self.units[-1].leaves.items():
                leaf.grad = res.grads[name] if leaf.grad is None else leaf.grad + res.grads[name]
            if tied is not None:
                w = embed["weight"]
                w.grad = w.grad + res.grads["lm_head.weight"] if w.grad is not None else res.grads["lm_head.weight"]
        return res.loss, backward, res.pairs

    def _accumulate_grads(self, m: int) -> None:
        for u in self.units:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in u.leaves.values()]
            views = list(u.spec.views(u.grad).values())
            if m == 0:
                torch._foreach_copy_(views, grads)
            else:
                torch._foreach_add_(views, grads)
            for p in u.leaves.values():
                p.grad = None

    @torch.no_grad()
    def token_losses(self, batch) -> torch.Tensor:
        x, labels = self._hidden(batch)
        tied = self.units[0].leaves["weight"] if self.split.tied else None
        return self.split.head_token_losses(self.units[-1].leaves, x, labels, lm_weight=tied,
                                            impl=self.rt.resolved_head_impl,
                                            chunk_tokens=self.rt.head.head_chunk_tokens)

    @torch.no_grad()
    def next_token_logits(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The logits of the token after each row's first lengths[b] tokens, with the current weights:
        input_ids [B, S] (right-padded; causal attention keeps the padding out of earlier positions),
        lengths [B] -> [B, V] float32. One full forward, no KV cache (evaluation/samples.py: greedy samples)."""
        split, dev = self.split, self.device.device
        ids = input_ids.to(dev)
        kwargs = split.layer_kwargs(*ids.shape, self.dtype, dev)
        x = split.embed_forward(self.units[0].leaves, ids)                     # [B, S, d]
        split.attach_sides(kwargs, self.units[0].leaves, ids, x)
        for i in range(split.num_layers):
            x = split.layer_forward(i, self.units[i + 1].leaves, x, kwargs[i])
        last = x[torch.arange(x.shape[0], device=dev), lengths.to(dev) - 1]     # [B, d]
        tied = self.units[0].leaves["weight"] if split.tied else None
        return split.head_logits(self.units[-1].leaves, last, lm_weight=tied)

    def synchronize(self) -> None:
        self.device.synchronize()

    def named_master_params(self, on_host: bool = True):
        """(HF name, FP32 master) for every parameter, copied to the host unless on_host=False."""
        for u in self.units:
            for p in u.spec.params:
                t = u.master[p.offset:p.offset + p.numel].view(p.shape)
                yield p.full_name, t.cpu() if on_host else t

    def optimizer_tensors(self, on_host: bool = True) -> dict[str, torch.Tensor]:
        """AdamW state by name, copied to the host unless on_host=False (left on the device)."""
        out = {}
        for u in self.units:
            for k, t in u.opt.state_tensors().items():
                out[f"{u.spec.name}.{k}"] = t.cpu() if on_host else t
        return out

    def load_state(self, masters: dict[str, torch.Tensor], optim: dict[str, torch.Tensor], step: int) -> None:
        with torch.no_grad():
            for u in self.units:
                for p in u.spec.params:
                    u.master[p.offset:p.offset + p.numel].view(p.shape).copy_(masters[p.full_name])
                u.opt.load_state_tensors({k: optim[f"{u.spec.name}.{k}"] for k in ("exp_avg", "exp_avg_sq", "step")})
                u.compute.copy_(u.master)
        self.step_index = step

    def memory_report(self) -> dict[str, int]:
        return {"gpu_buffers": 0, "pinned": 0, "host_state": 0}

    def close(self) -> None:
        self.gc_freeze.release()
