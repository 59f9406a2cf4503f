"""Inductor's compile-worker processes, released once compilation is over.

The first call of a `torch.compile`d function starts a pool of worker processes (one
per core; torch._inductor.async_compile.maybe_warm_pool), each importing torch and
Triton. When the graphs come from the FX cache, compilation ends in seconds while
those imports go on for several more on every core, and the first steps run beside
them: on the H100 host the Qwen3-4B b8 step took 1.6-1.7 s for five steps after a
cache hit and 1.10 s once the pool had settled (benchmarks/NOTES.md "Compile"),
because the host's AdamW needs all 16 cores. Idle, the workers still hold host RAM,
which an 8B run needs. Releasing the pool after a step that compiled frees both; a
later recompilation (a new shape) starts a fresh pool on its own.
"""
from __future__ import annotations


def release_compile_workers() -> bool:
    """Shut down inductor's compile-worker pools, if any are running. Returns whether
    one was. Uses torch's own shutdown (the private module's public-looking helper):
    on a torch without it, nothing happens."""
    try:
        from torch._inductor import async_compile
    except ImportError:            # torch built without inductor
        return False
    pools = getattr(async_compile, "_pool_set", None)
    shutdown = getattr(async_compile, "shutdown_compile_workers", None)
    if not pools or shutdown is None:
        return False
    shutdown()
    return True
