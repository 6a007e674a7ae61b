"""One markdown table of ratios from `dsa-pd bench serve` results of several engines.

Result files are named ``{engine}__{checkpoint}__in{input_len}__c{concurrency}.json`` (what
``bench/peers/run_peer.sh`` writes); the first engine named is the peer the others are
divided by.

    python -m bench.peers.table RESULTS_DIR --engines vllm dsa-mono dsa-pd > table.md
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

NAME = re.compile(r"^(?P<engine>[^_]+(?:-[^_]+)*)__(?P<ckpt>[^_]+)__in(?P<inp>\d+)__c(?P<conc>\d+)\.json$")


def load(results_dir: str | Path) -> dict[tuple[str, str, int, int], dict]:
    """``(engine, checkpoint, input_len, concurrency) -> saved bench-serve document``."""
    out = {}
    for p in sorted(Path(results_dir).glob("*.json")):
        m = NAME.match(p.name)
        if m:
            out[(m["engine"], m["ckpt"], int(m["inp"]), int(m["conc"]))] = json.loads(p.read_text())
    return out


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def table(docs: dict, engines: list[str]) -> str:
    """Rows: checkpoint x input length x concurrency. For each engine: output tokens/s, median
    TTFT and median TPOT; for the others also their ratio to the first (throughput: engine / peer,
    so < 1 is slower; latencies: engine / peer, so > 1 is slower). Failed requests are counted."""
    peer, others = engines[0], engines[1:]
    keys = sorted({k[1:] for k in docs})
    head = ["checkpoint", "in/out", "conc."]
    for e in engines:
        head += [f"{e} out tok/s", f"{e} TTFT p50 ms", f"{e} TPOT p50 ms"]
    for e in others:
        head += [f"{e}/{peer} tok/s", f"{e}/{peer} TPOT"]
    head += ["failed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for ckpt, inp, conc in keys:
        row = [ckpt, f"{inp}/{_out_len(docs, ckpt, inp, conc)}", str(conc)]
        got = {e: docs.get((e, ckpt, inp, conc)) for e in engines}
        for e in engines:
            d = got[e] or {}
            row += [_fmt(d.get("output_throughput"), ",.0f"), _fmt(d.get("median_ttft_ms"), ".1f"),
                    _fmt(d.get("median_tpot_ms"), ".2f")]
        p = got[peer] or {}
        for e in others:
            d = got[e] or {}
            row += [_fmt(_ratio(d.get("output_throughput"), p.get("output_throughput")), ".2f"),
                    _fmt(_ratio(d.get("median_tpot_ms"), p.get("median_tpot_ms")), ".2f")]
        row.append(", ".join(f"{e} {(got[e] or {}).get('failed', '-')}" for e in engines
                             if (got[e] or {}).get("failed")) or "0")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _out_len(docs: dict, ckpt: str, inp: int, conc: int) -> str:
    for (e, c, i, k), d in docs.items():
        if (c, i, k) == (ckpt, inp, conc) and d.get("requested_output_lens"):
            return str(max(d["requested_output_lens"]))
    return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results_dir")
    ap.add_argument("--engines", nargs="+", required=True, help="the peer first")
    args = ap.parse_args(argv)
    print(table(load(args.results_dir), args.engines), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
