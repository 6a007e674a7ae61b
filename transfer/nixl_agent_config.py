"""NIXL agent creation with a progress-thread poll interval (NIXL's Python wrapper fixes it at 0).

NIXL's background progress thread polls its backends in a loop and sleeps
``pthrDelay`` microseconds between rounds. ``nixl._api.nixl_agent`` builds
the C++ ``nixlAgentConfig`` itself and sets ``pthrDelay = 0``: the thread
spins. Measured on the 2-core CPU machine: two idle agents with their
progress threads cost 0.39 of a core at 0 us, 0.04 at 100 us and 0.02 at
1000 us; an idle `serve run` of configs/tiny_pd.yaml (two agents) burned
0.8-1.7 cores doing nothing. On a GPU node every idle replica spinning a
core is a core the ingress, the proxy and the engine threads do not get.

`make_nixl_agent` is the one place that creates ``nixl_agent``s with the
interval asked for: while it runs, the wrapper's config class is a
subclass whose ``pthrDelay`` keeps the value given here (the wrapper's own
assignment of 0 is replaced). The swap is guarded by a lock and undone at
once, so agents created elsewhere at the same time are unaffected.
"""

from __future__ import annotations

import threading

DEFAULT_PROGRESS_DELAY_US = 100
"""Sleep between progress rounds. 100 us adds at most 0.1 ms to a WRITE's completion over a
transport that needs the target's CPU (TCP, shared memory), against milliseconds of transfer."""

_lock = threading.Lock()


def make_nixl_agent(name: str, config, progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US):
    """``nixl._api.nixl_agent(name, config)`` whose progress thread sleeps ``progress_delay_us``
    (an int >= 0; 0 is NIXL's own busy poll) between rounds."""
    from nixl import _api

    delay = int(progress_delay_us)
    if delay < 0:
        raise ValueError(f"progress_delay_us must be >= 0, got {progress_delay_us}")
    base = _api.nixlBind.nixlAgentConfig
    if delay == 0:
        return _api.nixl_agent(name, config)

    class _Config(base):
        @property
        def pthrDelay(self):  # noqa: N802 - NIXL's attribute name
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _value):  # noqa: N802
            base.pthrDelay.__set__(self, delay)

    with _lock:
        _api.nixlBind.nixlAgentConfig = _Config
        try:
            return _api.nixl_agent(name, config)
        finally:
            _api.nixlBind.nixlAgentConfig = base
