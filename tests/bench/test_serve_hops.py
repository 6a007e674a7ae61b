"""`bench/serve_hops.py` runs Ray Serve's empty two-deployment app and times its three paths."""

from __future__ import annotations

import re

import pytest

from bench.serve_hops import main

pytestmark = pytest.mark.slow


def test_serve_hops_times_each_path(capsys):
    assert main(["--requests", "5", "--port", "8124"]) == 0
    out = capsys.readouterr().out
    times = {m.group(1): float(m.group(2)) for m in re.finditer(r"^/(\w+): p50 ([0-9.]+) ms", out, re.M)}
    assert set(times) == {"local", "unary", "stream"}, out
    assert all(t > 0 for t in times.values())
    # A handle call to another replica costs more than answering in the ingress alone.
    assert times["stream"] > times["local"] and times["unary"] > times["local"], times
