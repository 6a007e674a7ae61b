"""Per-request records and the benchmark's summary statistics.

Units: every time in a ``RequestResult`` is in **seconds** (``time.perf_counter``
differences); the summary (``summarize``) reports latencies in **milliseconds**
(keys ``*_ms``) and throughputs per second of benchmark duration. Token counts
are the server's (``usage``) where it sent them.

Definitions (docs/benchmarking.md has the long form):

* TTFT: request sent -> first content chunk arrived.
* ITL: the gaps between consecutive content chunks of one request. A chunk may
  carry several tokens (MTP, a server batching its stream): its gap is
  recorded once, not split over its tokens.
* TPOT: ``(e2el - ttft) / (output_tokens - 1)``: mean time per output token
  after the first; undefined (None) for requests with fewer than 2 tokens.
* E2EL: request sent -> last byte of the stream (``[DONE]``).
* Goodput: successful requests meeting every SLO given, per second.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What one request did. Times in seconds; ``start`` is ``time.perf_counter()``
    when the request was sent (after any wait for a concurrency slot)."""

    success: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float | None = None          # s, send -> first content chunk
    itl: list[float] = field(default_factory=list)  # s, gaps between content chunks
    e2el: float | None = None          # s, send -> end of stream
    output_tokens: int = 0             # usage.completion_tokens, else the count of content chunks
    prompt_tokens: int | None = None   # usage.prompt_tokens, else the dataset's count (None if unknown)
    output_tokens_from_usage: bool = False
    chunk_times: list[float] = field(default_factory=list)  # s since start, arrival of each content chunk
    generated_text: str = ""

    @property
    def tpot(self) -> float | None:
        """``(e2el - ttft) / (output_tokens - 1)`` in seconds; None with fewer than 2 tokens."""
        if not self.success or self.ttft is None or self.e2el is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between
    closest ranks (numpy's default, ``method="linear"``); NaN when empty."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside [0, 100]")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def std(values: Sequence[float]) -> float:
    """Population standard deviation (numpy's ``np.std``, ddof = 0); NaN when empty."""
    if not values:
        return math.nan
    m = mean(values)
    return math.sqrt(sum((x - m) ** 2 for x in values) / len(values))


def parse_goodput(items: Iterable[str] | None) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> ``{"ttft": 200.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME one of {', '.join(GOODPUT_METRICS)}, not {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if ms < 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be >= 0 ms")
        slos[name] = ms
    return slos


def meets_slos(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO (ms). A TPOT SLO is met by a
    request of fewer than 2 output tokens (it has no TPOT to violate it)."""
    if not r.success:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el}
    for name, limit in slos_ms.items():
        v = values[name]
        if v is None:
            if name == "tpot":
                continue
            return False
        if v * 1000.0 > limit:
            return False
    return True


def metric_values(results: Sequence[RequestResult], name: str) -> list[float]:
    """The seconds that metric ``name`` pools over the successful requests
    (ITL: every gap of every request, flattened)."""
    ok = [r for r in results if r.success]
    if name == "ttft":
        return [r.ttft for r in ok if r.ttft is not None]
    if name == "tpot":
        return [t for r in ok if (t := r.tpot) is not None]
    if name == "itl":
        return [g for r in ok for g in r.itl]
    if name == "e2el":
        return [r.e2el for r in ok if r.e2el is not None]
    raise ValueError(f"unknown metric {name!r}: one of {', '.join(METRICS)}")


def _fmt_q(q: float) -> str:
    return str(int(q)) if float(q).is_integer() else str(q)


def summarize(results: Sequence[RequestResult], duration_s: float, *,
              metrics: Sequence[str] = ("ttft", "tpot", "itl"),
              percentiles: Sequence[float] = (99,),
              goodput_slos_ms: dict[str, float] | None = None) -> dict:
    """The summary numbers of one run: counts, totals, throughputs (per second of
    ``duration_s``), and per chosen metric ``mean_/median_/std_/p{q}_{name}_ms``."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_tokens or 0 for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: math.nan)
    out: dict = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "request_goodput": None,
        "input_throughput": per_s(total_in),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
    }
    if goodput_slos_ms:
        out["request_goodput"] = per_s(sum(meets_slos(r, goodput_slos_ms) for r in ok))
    for name in metrics:
        ms = [v * 1000.0 for v in metric_values(results, name)]
        out[f"mean_{name}_ms"] = mean(ms)
        out[f"median_{name}_ms"] = percentile(ms, 50)
        out[f"std_{name}_ms"] = std(ms)
        out[f"percentiles_{name}_ms"] = [[q, percentile(ms, q)] for q in percentiles]
        for q in percentiles:
            out[f"p{_fmt_q(q)}_{name}_ms"] = percentile(ms, q)
    return out
