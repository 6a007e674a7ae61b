"""The step trace: every engine step of a replica as one JSON line, and what a window of them says.

The step-time histogram (``dsa_pd_engine_step_seconds``) gives a run's mean step, not where a run's wall
time went: a served run can last far longer than the sum of its steps (time the engine spends between
steps: emitting, admitting, waiting for work) and the histogram cannot show it. With
``DSA_PD_STEP_TRACE=DIR`` in the environment of the replicas (set where ``serve run`` starts; Ray's
local workers inherit it), each replica appends its steps to ``DIR/<role>-<pid>.jsonl`` at every
heartbeat, one line per step::

    {"role": "decode", "kind": "decode", "ended": 1764355200.123, "seconds": 0.0041, "tokens": 128}

``ended`` is the wall-clock time the step returned, ``seconds`` its duration as the engine's thread
measured it, ``tokens`` what `replica_stats.StepRecord` counts. Off (the default), nothing is written.

    python -m deployments.metrics.step_trace FILE [--skip N] [--run RESULT.json] [--gap-s 2.0] [--json OUT]

summarizes the steps after the first ``N`` lines (a run's, when ``N`` was the line count before it),
split into busy periods at idle gaps longer than ``--gap-s``: each period's wall time, the time inside
steps by kind, and the time between steps. ``--run``: only the steps that ran inside a
``dsa-pd bench serve`` run (its result's ``started_at`` and ``duration``), and how the client's run
compares with them: a run much longer than its steps waited on something else than the engine (the
way out to the client, session 23's ingress).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Iterable

from deployments.replica_stats import StepRecord

log = logging.getLogger("ray.serve")

ENV = "DSA_PD_STEP_TRACE"


class StepTrace:
    """Appends a replica's `StepRecord` s to its JSONL file (``None`` from `from_env` when tracing is off)."""

    def __init__(self, path: Path, role: str):
        self.path, self.role = path, role
        path.parent.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_env(cls, role: str) -> "StepTrace | None":
        where = os.environ.get(ENV)
        if not where:
            return None
        trace = cls(Path(where) / f"{role}-{os.getpid()}.jsonl", role)
        log.info("step trace: %s", trace.path)
        return trace

    def write(self, steps: Iterable[StepRecord]) -> None:
        lines = [json.dumps({"role": self.role, "kind": s.kind, "ended": round(s.ended, 6),
                             "seconds": round(s.seconds, 6), "tokens": s.tokens}) + "\n" for s in steps]
        if lines:
            with open(self.path, "a") as f:
                f.writelines(lines)


def read(path: Path, skip: int = 0) -> list[dict]:
    """The trace's steps after its first ``skip`` lines, in the order they ended."""
    with open(path) as f:
        rows = [json.loads(line) for i, line in enumerate(f) if i >= skip and line.strip()]
    return sorted(rows, key=lambda r: r["ended"])


def periods(steps: list[dict], gap_s: float) -> list[list[dict]]:
    """``steps`` split where the engine was idle (from one step's end to the next one's start) longer
    than ``gap_s``."""
    out: list[list[dict]] = []
    for s in steps:
        if out and s["ended"] - s["seconds"] - out[-1][-1]["ended"] <= gap_s:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def summarize(steps: list[dict]) -> dict:
    """One busy period: its wall time (first step's start to last step's end), the time inside steps by kind
    (count, seconds, tokens), and the time between consecutive steps (sum, largest, and how much of it was
    in gaps longer than 1 ms)."""
    start = steps[0]["ended"] - steps[0]["seconds"]
    wall = steps[-1]["ended"] - start
    kinds: dict[str, dict] = {}
    for s in steps:
        k = kinds.setdefault(s["kind"], {"steps": 0, "seconds": 0.0, "tokens": 0})
        k["steps"] += 1
        k["seconds"] += s["seconds"]
        k["tokens"] += s["tokens"]
    gaps = [max(0.0, b["ended"] - b["seconds"] - a["ended"]) for a, b in zip(steps, steps[1:])]
    for k in kinds.values():
        k["mean_ms"] = 1e3 * k["seconds"] / k["steps"]
    inside = sum(k["seconds"] for k in kinds.values())
    return {"wall_s": wall, "inside_steps_s": inside, "between_steps_s": sum(gaps),
            "largest_gap_ms": 1e3 * max(gaps, default=0.0), "gaps_over_1ms_s": sum(g for g in gaps if g > 1e-3),
            "kinds": kinds}


def in_run(steps: list[dict], started_at: float, duration: float) -> list[dict]:
    """The steps that started inside a client run (``started_at``, wall clock, lasting ``duration`` s)."""
    return [s for s in steps if started_at <= s["ended"] - s["seconds"] <= started_at + duration]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Summarize a replica's step trace (DSA_PD_STEP_TRACE).")
    ap.add_argument("trace", type=Path)
    ap.add_argument("--skip", type=int, default=0, help="lines written before the window of interest")
    ap.add_argument("--gap-s", type=float, default=2.0, help="idle time that separates two busy periods")
    ap.add_argument("--run", type=Path, help="a `dsa-pd bench serve` result: only the steps inside its run")
    ap.add_argument("--json", type=Path, help="write the periods' summaries here too")
    args = ap.parse_args(argv)
    steps = read(args.trace, args.skip)
    if args.run is not None:
        run = json.loads(args.run.read_text())
        steps = in_run(steps, run["started_at"], run["duration"])
        if steps:
            first = steps[0]["ended"] - steps[0]["seconds"] - run["started_at"]
            last = run["started_at"] + run["duration"] - steps[-1]["ended"]
            print(f"client run {run['duration']:.3f} s: its first step started {first:.3f} s in, its last step "
                  f"ended {last:.3f} s before the client's last token")
    out = [summarize(p) for p in periods(steps, args.gap_s)] if steps else []
    for i, p in enumerate(out):
        kinds = ", ".join(f"{name} {k['steps']} x {k['mean_ms']:.2f} ms ({k['tokens']} tokens)"
                          for name, k in sorted(p["kinds"].items()))
        print(f"period {i}: wall {p['wall_s']:.3f} s = {p['inside_steps_s']:.3f} s in steps + "
              f"{p['between_steps_s']:.3f} s between (largest gap {p['largest_gap_ms']:.1f} ms, "
              f"{p['gaps_over_1ms_s']:.3f} s in gaps > 1 ms); {kinds}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
