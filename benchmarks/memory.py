"""Peak CPU memory of a callable, from the allocator's own event stream.

With ``profile_memory=True`` the CPU allocator reports every allocation and free to
``torch.profiler``; summing the ``[memory]`` events of one call in time order gives the live-bytes
curve, whose maximum is the peak the call added on top of what existed before it.  Unlike RSS this
is exact, repeatable and unaffected by other processes.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated (and not yet freed) during ``fn()`` beyond what existed before."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak
