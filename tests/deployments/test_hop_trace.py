"""The hop trace (``DSA_PD_HOP_TRACE``): points written once per request, read back across processes' files,
and summarized hop by hop over the requests that followed the most common path."""

from __future__ import annotations

import pytest

from deployments.metrics import hop_trace


@pytest.fixture
def traced(tmp_path, monkeypatch):
    monkeypatch.setenv(hop_trace.ENV, str(tmp_path))
    monkeypatch.setattr(hop_trace, "_state", {})
    yield tmp_path
    f = hop_trace._state.get("file")
    if f is not None:
        f.close()


def test_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(hop_trace.ENV, raising=False)
    monkeypatch.setattr(hop_trace, "_state", {})
    hop_trace.mark("r", "ingress.parsed")
    assert not hop_trace.active() and not list(tmp_path.iterdir())


def test_marks_are_written_once_and_summarized_in_time_order(traced):
    assert hop_trace.active()
    hop_trace.mark("r1", "a")
    hop_trace.mark("r1", "a")  # a second passage is not written
    hop_trace.mark("r1", "b")
    lines = next(traced.glob("hops-*.txt")).read_text().splitlines()
    assert [ln.split()[:2] for ln in lines] == [["r1", "a"], ["r1", "b"]]
    # Another process's file, and requests whose points tell the hops' times.
    other = traced / "hops-1.txt"
    rows = []
    for i, (t0, d1, d2) in enumerate([(100.0, 0.001, 0.004), (101.0, 0.003, 0.002), (102.0, 0.002, 0.003)]):
        rows += [f"q{i} x {t0:.6f}", f"q{i} y {t0 + d1:.6f}", f"q{i} z {t0 + d1 + d2:.6f}"]
    rows.append("odd y 200.000000")  # a request with another path: not in the summary
    other.write_text("\n".join(rows) + "\n")
    reqs = hop_trace.read(traced)
    assert reqs["q1"] == {"x": 101.0, "y": 101.003, "z": 101.005}
    s = hop_trace.summarize({k: v for k, v in reqs.items() if k != "r1"})
    assert s["sequence"] == ["x", "y", "z"] and s["requests"] == 3 and s["of"] == 4
    assert [h["from"] + h["to"] for h in s["hops"]] == ["xy", "yz"]
    assert s["hops"][0]["median_ms"] == pytest.approx(2.0, abs=1e-3)
    assert s["hops"][1]["median_ms"] == pytest.approx(3.0, abs=1e-3)
    assert s["total"]["median_ms"] == pytest.approx(5.0, abs=1e-3)
    assert hop_trace.summarize(reqs, since=101.5)["requests"] == 1  # q2 alone of the x-y-z ones
    assert hop_trace.summarize(reqs, skip_first=2, since=100.5)["of"] == 2  # q1 skipped: q2 and odd
    assert hop_trace.main([str(traced), "--json", str(traced / "s.json")]) == 0
