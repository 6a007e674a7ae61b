"""Host data onto the device without making the host wait for the device.

``tensor.to("cuda")`` from pageable host memory is a blocking copy: PyTorch synchronizes the
stream after it, so the host waits for every kernel queued before the copy. On the decode path
that undoes overlap scheduling: the next step's inputs (a token index, the sampling rows'
parameters) were copied while the step before still ran, the host stalled until it finished,
and the device then idled while the host prepared and launched the rest of the step (H100,
session 18: a batch-1 step's wall time was 1.30x its GPU busy time, the stall 2.9 ms a step
under cProfile). Every host-to-device copy of the engine's per-step data goes through here.
"""

from __future__ import annotations

from typing import Sequence

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` on ``device``. A CPU tensor goes to CUDA through pinned memory, non-blocking: the
    caching host allocator keeps the pinned block until the copy has run, so ``host`` may be
    reused or freed at once. Anything else is a plain ``.to`` (a no-op where it already is)."""
    device = torch.device(device)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def tensor_on(data: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` on ``device`` through `to_device` (``torch.tensor(...,
    device="cuda")`` copies from pageable memory and blocks)."""
    return to_device(torch.tensor(data, dtype=dtype), device)
