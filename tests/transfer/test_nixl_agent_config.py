"""The NIXL progress thread sleeps between polling rounds (`transfer.nixl_agent_config`)."""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("nixl")


def _thread_cpu_s() -> dict[int, float]:
    """CPU seconds of each thread of this process (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _idle_progress_cpu(delay_us: int, seconds: float = 1.5) -> float:
    """Cores used by the threads a new agent (UCX backend, progress thread) starts, while idle."""
    from nixl._api import nixl_agent_config

    from transfer.nixl_agent_config import make_nixl_agent

    before = set(_thread_cpu_s())
    agent = make_nixl_agent(f"idle-{delay_us}", nixl_agent_config(enable_prog_thread=True, backends=[]), delay_us)
    agent.create_backend("UCX", {})
    time.sleep(0.2)
    a = {t: c for t, c in _thread_cpu_s().items() if t not in before}
    time.sleep(seconds)
    b = _thread_cpu_s()
    used = sum(b.get(t, c) - c for t, c in a.items()) / seconds
    del agent
    return used


def test_an_idle_agent_sleeps_between_progress_rounds_and_nixl_busy_polls_at_0():
    from nixl import _api

    base = _api.nixlBind.nixlAgentConfig
    sleeping = _idle_progress_cpu(1000)
    assert _api.nixlBind.nixlAgentConfig is base  # the swap is undone
    spinning = _idle_progress_cpu(0)
    # A spinning thread takes a large share of a core even on a busy 2-core machine; a
    # thread that sleeps 1 ms a round takes a few percent.
    assert sleeping < 0.1 and spinning > 2 * sleeping + 0.05, (sleeping, spinning)


def test_a_negative_delay_is_refused():
    from nixl._api import nixl_agent_config

    from transfer.nixl_agent_config import make_nixl_agent

    with pytest.raises(ValueError, match="progress_delay_us"):
        make_nixl_agent("bad", nixl_agent_config(enable_prog_thread=True, backends=[]), -1)
