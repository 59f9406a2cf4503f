"""Python's garbage collector during training.

A full (generation 2) collection walks every tracked object of the process: the model's
modules, parameters' Python wrappers, compiled graphs, the engine's bookkeeping. While it runs
every Python thread stands still, the compute thread that launches the GPU's kernels included,
so the GPU runs dry. On the H100 host one such collection inside a Qwen3-4B batch-16 step took
0.54 s of a 1.06 s step (benchmarks/NOTES.md "GC pauses"). What is alive after the first step (the
model built, graphs compiled, buffers allocated) lives as long as the run: moved to the
permanent generation (gc.freeze) it is never walked again, and the collections that remain see
only what the steps themselves create.
"""
from __future__ import annotations

import gc


class GCFreeze:
    """freeze() once the long-lived objects exist; release() when they may die again.

    gc.freeze() is process-wide: objects in the permanent generation are never collected, so an
    engine that is closed while frozen, if it sits in a reference cycle (threads holding bound
    methods do), would never be freed. release() moves them back (gc.unfreeze) so a later
    collection frees the closed engine's memory."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.frozen = False

    def freeze(self) -> None:
        if self.enabled and not self.frozen:
            gc.collect()        # the set-up's garbage first: frozen garbage would never be freed
            gc.freeze()
            self.frozen = True

    def release(self) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
