"""compile_layers=auto: compile the decoder layers where the run earns the compile back.

torch.compile'd layers ran 487 model TFLOPS against 401 eager on the H100 (one Llama-3.1-8B
layer, 16 x 1024 tokens, forward + recompute + backward; docs/contract.md): a compiled
step spends 18% less time in its layers. The compile costs about 40 s at start-up
(README, one graph per kind of layer; less when inductor's FX cache has the graphs). So the
planned run is worth compiling when the time it saves, steps x 18% of the layers' compute,
is at least PAYBACK times the compile. Layer compute is estimated from the model's FLOPs
(telemetry/flops.py: 6N + attention, recompute not counted, as the 401/487 model TFLOPS are)
at the eager rate: an estimate, stated as such in the reason the resolved config prints.

Only slide mode compiles layers, and only on CUDA (inductor's CPU code is not what the
measurements above are of, and a CPU run has seconds to spare for nothing).

The fit counts HF's layer compiled where compile_layers is on or auto on CUDA (engine/fit/byte_models.fit_counts_compiled:
~0.6 of the eager layer's bytes), so a placement may fit only compiled; train then resolves auto on
whatever the payback (choose_compile_layers' placement_needs_it).

Where the compile cache holds this run's layers (engine/compile_cache.py: an earlier run of the same
layers, shape and settings compiled them) the compile costs a fraction of a cold one, and shorter
runs earn it back.
"""
from __future__ import annotations

import dataclasses

from ..models.units import SplitModel
from ..telemetry.flops import train_flops_per_token
from .config import RuntimeConfig

EAGER_LAYER_TFLOPS = 401.0      # measured, H100 (docs/contract.md)
COMPILED_LAYER_TFLOPS = 487.0   # measured, same layer and batch
COMPILE_S = 40.0                # start-up compile of an 8B's layers on the H100 host (README)
# The compile when the cache holds this run's layers (engine/compile_cache.py), as a fraction of the
# cold one: Dynamo still traces the layers, inductor and AOTAutograd read their results from disk.
# Measured on CPU (2026-11-29, `slidetune train` of a 2-layer tiny-llama, [2, 32] tokens, 2 shared
# cores, torch 2.13; dynamo's compile seconds as the first step prints them): 35.2 and 43.1 s cold,
# 4.3 and 3.4 s from the cache, ~0.1 of it. The H200's own figure for an 8B is still to be measured.
WARM_COMPILE_FRACTION = 0.1
# The compile must come back this many times over. 2.5: the default 8B run (300 steps of
# 16 x 1024 tokens, ~0.36 s saved a step) earns it back ~2.7x, so it compiles; a 20-step try or
# a small model's run does not.
PAYBACK = 2.5


@dataclasses.dataclass(frozen=True)
class CompileChoice:
    compile_layers: str         # on | off
    reason: str


def choose_compile_layers(rt: RuntimeConfig, split: SplitModel, *, is_cuda: bool, steps: int,
                          tokens_per_step: int, seq_len: int, cached: bool = False,
                          placement_needs_it: bool = False) -> CompileChoice:
    """What compile_layers=auto resolves to for a run of `steps` optimizer steps of
    `tokens_per_step` tokens; an explicit on/off is kept, with its reason. cached: the compile
    cache holds these layers (compile_cache.cache_holds): the compile costs WARM_COMPILE_FRACTION of it.
    placement_needs_it: the placement fits with HF's layer compiled and not eager (fit/byte_models.fit_counts_compiled),
    so auto compiles whatever the payback."""
    if rt.compile_layers != "auto":
        return CompileChoice(rt.compile_layers, "set explicitly")
    if rt.mode != "slide":
        return CompileChoice("off", f"{rt.mode} mode does not compile layers")
    if not is_cuda:
        return CompileChoice("off", "not on CUDA")
    if placement_needs_it:
        return CompileChoice("on", "the placement fits with the compiled layer's working set, not the eager one's "
                                   "(--compile-layers off places for the eager layer)")
    # model FLOPs of a step, the measure the eager and compiled rates above are in
    flops = train_flops_per_token(split, seq_len) * tokens_per_step
    eager_s = flops / (EAGER_LAYER_TFLOPS * 1e12)
    saved_s = eager_s * (1 - EAGER_LAYER_TFLOPS / COMPILED_LAYER_TFLOPS)
    compile_s = COMPILE_S * WARM_COMPILE_FRACTION if cached else COMPILE_S
    earned = steps * saved_s / compile_s
    est = (f"{steps} steps x ~{saved_s:.3f} s saved a step (~{eager_s:.2f} s of layer compute eager, "
           f"{1 - EAGER_LAYER_TFLOPS / COMPILED_LAYER_TFLOPS:.0%} less compiled) against a ~{compile_s:.0f} s "
           f"compile{' (from the compile cache)' if cached else ''}: {earned:.1f}x")
    if earned >= PAYBACK:
        return CompileChoice("on", est + f" >= {PAYBACK:g}x")
    return CompileChoice("off", est + f" < {PAYBACK:g}x (--compile-layers on compiles anyway)")


def resolve_compile_layers(rt: RuntimeConfig, choice: CompileChoice) -> RuntimeConfig:
    return dataclasses.replace(rt, compile_layers=choice.compile_layers)
