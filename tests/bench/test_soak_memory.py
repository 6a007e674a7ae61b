"""`bench.soak.memory.processes`: every process a `/stats` answer names, an engine process included."""

from __future__ import annotations

from bench.soak.memory import processes


def test_processes_include_engine_processes():
    stats = {"prefill": [{"agent": "p1", "pid": 11, "engine_pid": 12}],
             "decode": [{"agent": "d1", "pid": 21, "engine_pid": None}], "ingress": {"pid": 31}}
    assert processes(stats) == {"prefill-p1": 11, "prefill-p1-engine": 12, "decode-d1": 21, "ingress": 31}
