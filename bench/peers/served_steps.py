"""What the served engine did during a benchmark run, from its own Prometheus series.

The served TPOT of a monolithic replica at concurrency 32 / 128 was 2-5x the offline step (docs/perf.md,
session 18), and the client cannot tell whether the engine's steps were slow (GPU, host, GIL) or the
tokens were slow to reach it (Serve's streaming). The replica records every step
(``dsa_pd_engine_step_seconds{kind=prefill|decode|verify}``) and every token: two snapshots of Ray's
metrics endpoints around a run give the run's mean step time per kind, to set beside the offline
step and the client's TPOT.

    python -m bench.peers.served_steps snapshot OUT.json [--ray-tmp /tmp]
    python -m bench.peers.served_steps diff BEFORE.json AFTER.json [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

PREFIX = "ray_dsa_pd_"
KEEP_LABELS = ("role", "kind", "model")
"""Labels kept in a series' key; Ray's per-process ones are dropped, so the replicas of one role add up."""


def scrape(ray_tmp: str | Path = "/tmp") -> str:
    """Everything Ray's metrics endpoints of the local cluster export now (every node's agent once:
    ``session_latest`` links to a session directory the glob finds too)."""
    found = {p.resolve() for p in Path(ray_tmp).glob("ray/session_*/prom_metrics_service_discovery.json")}
    targets = {t for path in found for group in json.loads(path.read_text()) for t in group["targets"]}
    out = []
    for target in sorted(targets):
        try:
            with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as r:
                out.append(r.read().decode())
        except OSError:
            pass  # an agent not up (yet)
    return "\n".join(out)


def series(text: str) -> dict[str, float]:
    """``{'name{label=value,...}': value}`` of the dsa-pd counters and histogram sums / counts in the
    exposition ``text`` (`KEEP_LABELS` only, sorted)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.startswith(PREFIX) or not s.name.endswith(("_sum", "_count", "_total")):
                continue
            labels = ",".join(f"{k}={s.labels[k]}" for k in sorted(s.labels) if k in KEEP_LABELS)
            key = f"{s.name}{{{labels}}}"
            out[key] = out.get(key, 0.0) + s.value
    return out


def diff(before: dict[str, float], after: dict[str, float]) -> dict:
    """Per histogram that moved: ``{count, mean_s}`` over the run; per counter that moved: its increase."""
    hist, counters = {}, {}
    for key, v in after.items():
        name, labels = key.split("{", 1)
        delta = v - before.get(key, 0.0)
        if name.endswith("_count") and delta > 0:
            base = name[: -len("_count")]
            total = after.get(f"{base}_sum{{{labels}", 0.0) - before.get(f"{base}_sum{{{labels}", 0.0)
            hist[f"{base}{{{labels}"] = {"count": delta, "mean_s": total / delta}
        elif name.endswith("_total") and delta > 0:
            counters[key] = delta
    return {"histograms": hist, "counters": counters}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snapshot")
    s.add_argument("out")
    s.add_argument("--ray-tmp", default="/tmp")
    d = sub.add_parser("diff")
    d.add_argument("before")
    d.add_argument("after")
    d.add_argument("--json")
    args = ap.parse_args()
    if args.cmd == "snapshot":
        Path(args.out).write_text(json.dumps(series(scrape(args.ray_tmp))))
        return 0
    res = diff(json.loads(Path(args.before).read_text()), json.loads(Path(args.after).read_text()))
    for key, h in sorted(res["histograms"].items()):
        if "step_seconds" in key or "ttft" in key or "itl" in key:
            print(f"{key}: {h['count']:.0f} x {1e3 * h['mean_s']:.2f} ms")
    for key, v in sorted(res["counters"].items()):
        if "tokens" in key:
            print(f"{key}: +{v:.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
