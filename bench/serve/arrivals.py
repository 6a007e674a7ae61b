"""When each request is sent: offsets in seconds from the benchmark's start.

``--request-rate R`` (requests/s): inter-arrival gaps drawn from a gamma
distribution of mean ``1/R`` and shape ``burstiness`` (1.0, the default, is
the exponential distribution: a Poisson process). ``inf`` sends everything at
offset 0. The same seed gives the same schedule.
"""

from __future__ import annotations

import math
import random


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int | None = 0) -> list[float]:
    """``n`` non-decreasing send times in seconds (the first request at 0)."""
    if n < 0:
        raise ValueError("the number of requests must be >= 0")
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), not {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, not {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)  # gamma scale: mean gap = shape * scale = 1 / rate
    t, out = 0.0, []
    for i in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, theta)
    return out
