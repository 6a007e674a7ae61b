"""The arrival pattern of the mixed-step tests (CPU and GPU): prompts that decode while others arrive."""

from __future__ import annotations

from workers.request import Request
from workers.sample.params import SamplingParams


def drive_arrivals(eng, early: list[list[int]], late: list[list[int]], together: list[list[int]],
                   new_tokens: int) -> tuple[list[Request], int]:
    """``early`` decode first; each of ``late`` arrives alone while they decode (one step each); then all of
    ``together`` arrive for one step; the engine runs until done. Returns (the requests in that order, the
    engine's `mixed_steps` counted after ``early`` had started)."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    reqs = [Request(f"e{i}", p, params) for i, p in enumerate(early)]
    for r in reqs:
        eng.add_request(r)
    while not all(r.output for r in reqs):
        eng.step()
    mixed = eng.stats.mixed_steps
    for i, p in enumerate(late):
        r = Request(f"l{i}", p, params)
        reqs.append(r)
        eng.add_request(r)
        eng.step()
    for i, p in enumerate(together):
        r = Request(f"t{i}", p, params)
        reqs.append(r)
        eng.add_request(r)
    eng.step()
    while eng.has_work:
        eng.step()
    eng.flush()
    return reqs, eng.stats.mixed_steps - mixed
