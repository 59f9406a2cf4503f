"""Per-layer spans and memory points of an unmodified HF causal LM, from hooks.

The techniques study trains HF models as they are (their attention kernels, autocast,
HF's own gradient checkpointing), so there is no engine loop to put timer spans in.
Hooks give the same record as the slide and plain engines (EventTimer spans, memory
points), so the scenarios' common tables and plots cover these runs too:

  forward   a decoder layer's forward: forward pre-hook -> forward hook;
  backward  from the gradient reaching the layer's output to the gradient of its input
            (tensor hooks registered in the forward);
  recompute under gradient checkpointing the layer's forward re-runs inside that backward
            interval. torch's non-reentrant checkpoint stops the re-run as soon as the last
            tensor the backward needs exists ("early stop", its default), so the forward
            hook that would mark the re-run's end never fires and hooks cannot see where it
            ends: with early stop the recompute stays inside the layer's backward time (and
            the report says so). With early stop off
            (torch.utils.checkpoint.set_checkpoint_early_stop(False)) the re-run completes,
            gets its own "recompute" span and is taken out of the backward;
  head / head_backward / embed_backward / optimizer: marked by the training loop through
            `head()`, `backward_begin()`, `backward_end()` and the timer's own spans.

Events are recorded on the current stream when the hook runs (autograd runs a CUDA
backward's hooks on the stream of the forward op), so spans time the GPU work in between.
Memory points read the caching allocator at each mark (its accounting is on the host, so
the value is the allocator's state when the hook ran).
"""
from __future__ import annotations

from functools import partial

import torch

from .events import EventTimer, Span
from .memory_timeline import MemoryTimeline


# the backward interval of a layer as the hooks see it: its recompute runs inside
NESTED_BACKWARD = "backward_incl_recompute"


class ModuleProbe:
    def __init__(self, layers: torch.nn.ModuleList, timer: EventTimer, memory: MemoryTimeline):
        self.timer, self.memory = timer, memory
        self.in_backward = False           # set by the loop around loss.backward()
        self._fwd: dict[int, tuple[str, object]] = {}
        self._bwd: dict[int, object] = {}
        self._bwd_begin = None
        self._last_input_grad = None       # mark when layer 0's input gradient was done
        self._handles = []
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(partial(self._pre, i), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(partial(self._post, i), with_kwargs=True))

    # ------------------------------------------------------------ hooks
    def _pre(self, i: int, module, args, kwargs):
        phase = "recompute" if self.in_backward else "forward"
        self._fwd[i] = (phase, self.timer.mark(phase, i))
        if phase == "forward":
            x = args[0] if args else kwargs.get("hidden_states")
            if torch.is_tensor(x) and x.requires_grad:
                x.register_hook(partial(self._input_grad, i))
        return None

    def _post(self, i: int, module, args, kwargs, output):
        phase, start = self._fwd.pop(i)
        self.timer.add(phase, i, start, self.timer.mark(phase, i))
        self.memory.mark(phase, i)
        if phase == "forward":
            y = output[0] if isinstance(output, (tuple, list)) else output
            if torch.is_tensor(y) and y.requires_grad:
                y.register_hook(partial(self._output_grad, i))
        return None

    def _output_grad(self, i: int, grad):
        self._bwd[i] = self.timer.mark("backward", i)
        return None

    def _input_grad(self, i: int, grad):
        start = self._bwd.pop(i, None)
        end = self.timer.mark("backward", i)
        if start is not None:
            self.timer.add(NESTED_BACKWARD, i, start, end)     # recompute included; split in step_spans
        self.memory.mark("backward", i)
        self._last_input_grad = end
        return None

    # ------------------------------------------------------------ marks from the loop
    def head(self, hidden: torch.Tensor, start) -> None:
        """The head's forward ran from `start` (a timer mark) to now; its backward ends when the
        gradient of `hidden` (the last layer's output, [B, S, d]) is computed."""
        self.timer.add("head", -1, start, self.timer.mark("head"))
        self.memory.mark("head")
        if hidden.requires_grad:
            hidden.register_hook(self._head_grad)

    def _head_grad(self, grad):
        if self._bwd_begin is not None:
            self.timer.add("head_backward", -1, self._bwd_begin, self.timer.mark("head_backward"))
        return None

    def backward_begin(self) -> None:
        self.in_backward = True
        self._bwd_begin = self.timer.mark("backward")
        self._last_input_grad = None

    def backward_end(self) -> None:
        """After loss.backward(): what ran after layer 0's input gradient is the embedding's."""
        self.in_backward = False
        if self._last_input_grad is not None:
            self.timer.add("embed_backward", -1, self._last_input_grad, self.timer.mark("embed_backward"))
        self.memory.mark("embed_backward")
        self._bwd_begin = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def step_spans(spans: list[Span]) -> list[tuple[str, int, float]]:
    """(phase, layer, ms) of one step; a hook-measured backward interval becomes "backward"
    with that layer's recompute taken out (it ran inside). Other spans pass unchanged."""
    recompute: dict[int, float] = {}
    for s in spans:
        if s.phase == "recompute":
            recompute[s.layer] = recompute.get(s.layer, 0.0) + s.ms
    out = []
    for s in spans:
        if s.phase == NESTED_BACKWARD:
            out.append(("backward", s.layer, max(0.0, s.ms - recompute.get(s.layer, 0.0))))
        else:
            out.append((s.phase, s.layer, s.ms))
    return out
