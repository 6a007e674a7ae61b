"""CUDA activity of a callable under torch.profiler, for the GPU benches."""

from __future__ import annotations

import torch


def profile_calls(fn, reps: int):
    """Run ``fn`` once (warm-up), then ``reps`` times under the profiler; returns the profile.

    Callers read it per kernel (``key_averages()``) or as a sum (``events()``).
    """
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return prof
