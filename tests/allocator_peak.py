"""The CPU allocator's peak while a function runs, from the profiler's memory events: what the fit
estimates (engine/fit/) are checked against on the CPU."""
from __future__ import annotations

import warnings

import pytest


def allocator_peak(fn) -> int:
    """Peak bytes the CPU allocator holds while fn runs, above what it held before."""
    from torch.profiler import ProfilerActivity, profile
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    try:
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        events.sort(key=lambda e: e.start_ns())
        deltas = [e.nbytes() for e in events]
    except AttributeError:  # pragma: no cover - profiler internals moved
        pytest.skip("profiler memory events not available in this torch")
    cur = peak = 0
    for n in deltas:
        cur += n
        peak = max(peak, cur)
    return peak
