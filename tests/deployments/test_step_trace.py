"""`deployments.metrics.step_trace`: the trace a replica writes and what its summary says of a run."""

from __future__ import annotations

import json

from deployments.metrics.step_trace import StepTrace, in_run, main, periods, read, summarize
from deployments.replica_stats import StepRecord


def _steps(t0: float) -> list[StepRecord]:
    """A warm-up decode step, then 4 s later a run: a 100 ms prefill, 10 ms idle, three 5 ms decodes back to back."""
    out = [StepRecord("decode", 0.005, 2, ended=t0 + 0.005)]
    out.append(StepRecord("prefill", 0.1, 4096, ended=t0 + 4.1))
    end = t0 + 4.11
    for _ in range(3):
        end += 0.005
        out.append(StepRecord("decode", 0.005, 128, ended=end))
    return out


def test_trace_periods_and_a_client_run(tmp_path, capsys):
    trace = StepTrace(tmp_path / "trace" / "decode-1.jsonl", "decode")
    t0 = 1_800_000_000.0
    steps = _steps(t0)
    trace.write(steps[:2])
    trace.write([])  # a heartbeat without steps writes nothing
    trace.write(steps[2:])
    rows = read(trace.path)
    assert [r["kind"] for r in rows] == ["decode", "prefill", "decode", "decode", "decode"]
    assert len(read(trace.path, skip=2)) == 3
    warm, run = periods(rows, gap_s=2.0)
    assert len(warm) == 1 and len(run) == 4
    s = summarize(run)
    assert abs(s["wall_s"] - 0.125) < 1e-6 and abs(s["inside_steps_s"] - 0.115) < 1e-6
    assert abs(s["between_steps_s"] - 0.010) < 1e-6 and abs(s["largest_gap_ms"] - 10.0) < 1e-3
    dec = s["kinds"]["decode"]
    assert dec["steps"] == 3 and dec["tokens"] == 384 and abs(dec["mean_ms"] - 5.0) < 1e-6
    # A client run from t0 + 3.9 s lasting 0.5 s holds the run's steps, not the warm-up's.
    assert in_run(rows, t0 + 3.9, 0.5) == run
    result = tmp_path / "r.json"
    result.write_text(json.dumps({"started_at": t0 + 3.9, "duration": 0.5}))
    assert main([str(trace.path), "--run", str(result), "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "client run 0.500 s: its first step started 0.100 s in, its last step ended 0.275 s before" in out
    (saved,) = json.loads((tmp_path / "s.json").read_text())
    assert saved["kinds"]["prefill"]["tokens"] == 4096
