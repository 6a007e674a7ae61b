"""The hop trace: when a request passed each point of its path, across processes, and where its first token's time went.

A served first token's time is mostly not the engine's step (dev CPU, a 4-token prompt: 13.5 ms in all, the
step 4.5 ms; H200, 1024 tokens: 27.2 ms TTFT, the step 13.4 ms). With ``DSA_PD_HOP_TRACE=DIR`` in the
environment of the replicas (set where ``serve run`` starts; Ray's local workers and the engine processes
inherit it) each process appends ``<request id> <point> <wall-clock time>`` lines to ``DIR/hops-<pid>.txt``
as a request passes:

==========================  ==================================================================
``ingress.parsed``          the ingress has parsed and validated the body, before admission
``ingress.dispatched``      its call to a decode replica is made
``decode.entered``          the decode replica's ``generate`` starts
``engine.added``            monolithic: the engine's thread takes the request
``prefill.entered``         PD: the prefill replica's ``prefill`` call starts
``prefill.emitted``         PD: the prefill replica's thread hands on its result (the first token)
``engine.emitted``          the decode engine's thread hands on the request's first output with tokens
``decode.received``         that output reaches the replica's reader thread (an engine process's;
                            ``prefill.received``: the prefill replica's)
``prefill.returned``        PD: the prefill replica's call has its result (returned to decode next)
``decode.yielded``          the replica yields the request's first output to Serve
``ingress.first_output``    the ingress has the first output
==========================  ==================================================================

Off (the default) each point costs a function call. Only the first passage of a point per request is
written. The clocks are one host's (the processes of one node).

    python -m deployments.metrics.hop_trace DIR [--since EPOCH] [--skip-first N] [--json OUT]

reads every process's file and prints, for the most common sequence of points, the median and p90 of each
hop over the requests that passed them all in that order.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import threading
import time
from pathlib import Path

ENV = "DSA_PD_HOP_TRACE"

_lock = threading.Lock()
_state: dict = {}  # "file": the open file, or None when off; "seen": (request id, point) written


def _file():
    if "file" not in _state:
        where = os.environ.get(ENV)
        if where:
            Path(where).mkdir(parents=True, exist_ok=True)
            _state["file"] = open(Path(where) / f"hops-{os.getpid()}.txt", "a", buffering=1)
        else:
            _state["file"] = None
        _state["seen"] = set()
    return _state["file"]


def mark(request_id: str, point: str) -> None:
    """Record that ``request_id`` passed ``point`` now (the first passage only; a no-op when tracing is off)."""
    f = _state.get("file", 0)
    if f is None:
        return
    t = time.time()
    with _lock:
        f = _file()
        if f is None or (request_id, point) in _state["seen"]:
            return
        seen = _state["seen"]
        if len(seen) > 100_000:  # a long run: forget old requests (a point is written once per request anyway)
            seen.clear()
        seen.add((request_id, point))
        f.write(f"{request_id} {point} {t:.6f}\n")


def active() -> bool:
    """Whether tracing is on here (for callers that would loop over many items to `mark` them)."""
    with _lock:
        return _file() is not None


def carries_tokens(item) -> bool:
    """Whether an engine output holds tokens (a `workers.request.RequestOutput` with ``token_ids``, a
    successful `workers.prefill_worker.PrefillResult`): the engine's other items for a request (a PD
    reservation's answer, an abort's) are not its first output."""
    return bool(getattr(item, "token_ids", None)) or getattr(item, "first_token", -1) >= 0


def read(where: Path) -> dict[str, dict[str, float]]:
    """``{request id: {point: time}}`` from every ``hops-*.txt`` in ``where`` (the earliest time per point)."""
    out: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for path in sorted(Path(where).glob("hops-*.txt")):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) != 3:
                continue
            rid, point, t = parts[0], parts[1], float(parts[2])
            if point not in out[rid] or t < out[rid][point]:
                out[rid][point] = t
    return dict(out)


def summarize(requests: dict[str, dict[str, float]], skip_first: int = 0, since: float = 0.0) -> dict:
    """The most common sequence of points (in time order) and, over the requests that followed it (those
    whose first point is after ``since``, less the first ``skip_first`` of them by start time: warm-ups),
    each hop's median and p90 in ms, and the whole sequence's."""
    by_order = sorted((p for p in requests.values() if min(p.values()) >= since),
                      key=lambda pts: min(pts.values()))[skip_first:]
    paths = collections.Counter(tuple(sorted(p, key=p.get)) for p in by_order)
    if not paths:
        return {"requests": 0, "sequence": [], "hops": []}
    seq, count = paths.most_common(1)[0]
    runs = [p for p in by_order if tuple(sorted(p, key=p.get)) == seq]

    def stats(values: list[float]) -> dict:
        values = sorted(values)
        return {"median_ms": statistics.median(values), "p90_ms": values[int(0.9 * (len(values) - 1))]}

    hops = [{"from": a, "to": b, **stats([1e3 * (p[b] - p[a]) for p in runs])} for a, b in zip(seq, seq[1:])]
    return {"requests": count, "of": len(by_order), "sequence": list(seq), "hops": hops,
            "total": stats([1e3 * (p[seq[-1]] - p[seq[0]]) for p in runs])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Where served requests' time went between the points of their "
                                             "path (DSA_PD_HOP_TRACE).")
    ap.add_argument("dir")
    ap.add_argument("--skip-first", type=int, default=0, help="leave out the first N requests (warm-ups)")
    ap.add_argument("--since", type=float, default=0.0, help="only requests that started after this wall-clock time")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    s = summarize(read(Path(args.dir)), args.skip_first, args.since)
    print(f"{s['requests']} of {s.get('of', 0)} requests followed the most common path")
    for h in s["hops"]:
        print(f"  {h['from']:>22} -> {h['to']:<22} median {h['median_ms']:7.2f} ms  p90 {h['p90_ms']:7.2f} ms")
    if s["hops"]:
        print(f"  {'all':>22}    {'':<22} median {s['total']['median_ms']:7.2f} ms  p90 {s['total']['p90_ms']:7.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
