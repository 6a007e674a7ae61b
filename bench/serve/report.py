"""The benchmark's outputs: the table printed on stdout and the JSON result document.

JSON units: per-request arrays in seconds (``ttfts``, ``tpots``, ``itls``,
``e2els``, ``start_times``) and tokens (``input_lens``, ``output_lens``);
summary latencies in milliseconds (``*_ms``); throughputs per second.
NaN (a statistic over no values) is written as null. docs/benchmarking.md
lists every key.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.serve.datasets import SampleRequest
from bench.serve.metrics import METRIC_TITLES, RequestResult

WIDTH = 50


def _q_word(q: float) -> str:
    return str(int(q)) if float(q).is_integer() else str(q)


def format_table(summary: dict, *, metrics: Sequence[str], percentiles: Sequence[float],
                 max_concurrency: int | None, request_rate: float,
                 results: Sequence[RequestResult] = ()) -> str:
    """The human-readable table (the layout of ``vllm bench serve``'s)."""
    lines = [" Serving Benchmark Result ".center(WIDTH, "=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        if isinstance(value, float) and math.isnan(value):
            text = "n/a"
        else:
            text = format(value, fmt) if fmt else str(value)
        lines.append(f"{label:<40} {text:<10}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Maximum request concurrency:", max_concurrency if max_concurrency else "unlimited")
    row("Request rate (req/s):", "inf" if math.isinf(request_rate) else request_rate)
    row("Benchmark duration (s):", summary["duration"], ".2f")
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"], ".2f")
    if summary.get("request_goodput") is not None:
        row("Request goodput (req/s):", summary["request_goodput"], ".2f")
    row("Input token throughput (tok/s):", summary["input_throughput"], ".2f")
    row("Output token throughput (tok/s):", summary["output_throughput"], ".2f")
    row("Total token throughput (tok/s):", summary["total_token_throughput"], ".2f")
    for name in metrics:
        title, short = METRIC_TITLES[name]
        lines.append(title.center(WIDTH, "-"))
        row(f"Mean {short} (ms):", summary[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", summary[f"median_{name}_ms"], ".2f")
        row(f"Std {short} (ms):", summary[f"std_{name}_ms"], ".2f")
        for q, value in summary[f"percentiles_{name}_ms"]:
            row(f"P{_q_word(q)} {short} (ms):", value, ".2f")
    lines.append("=" * WIDTH)
    failed = [(i, r.error) for i, r in enumerate(results) if not r.success]
    if failed:
        lines.append(f"Failed requests ({len(failed)}):")
        for i, err in failed[:20]:
            lines.append(f"  #{i}: {err}")
        if len(failed) > 20:
            lines.append(f"  ... and {len(failed) - 20} more (all in the saved JSON's \"errors\")")
    return "\n".join(lines)


def _clean(x: Any) -> Any:
    """JSON-safe: NaN -> None, inf -> "inf", recursively."""
    if isinstance(x, float):
        if math.isnan(x):
            return None
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def result_document(*, summary: dict, results: Sequence[RequestResult], requests: Sequence[SampleRequest],
                    config: dict, model: str, url: str, goodput_slos_ms: dict[str, float],
                    date: datetime | None = None) -> dict:
    """The saved JSON: run description, summary, and per-request arrays (index i = request i)."""
    date = date or datetime.now()
    t0 = min((r.start for r in results), default=0.0)
    # Request starts are perf_counter readings; the wall clock of the first lets a server-side trace
    # (``deployments.metrics.step_trace``: ``time.time()`` end times) be laid beside the run.
    epoch = time.time() - time.perf_counter()
    doc = {
        "date": date.strftime("%Y%m%d-%H%M%S"),
        "started_at": t0 + epoch if results else None,
        "backend": "openai",
        "url": url,
        "model_id": model,
        "num_prompts": len(requests),
        "request_rate": config.get("request_rate"),
        "burstiness": config.get("burstiness"),
        "max_concurrency": config.get("max_concurrency"),
        "goodput_slos_ms": goodput_slos_ms,
        "config": config,
        **summary,
        "successes": [r.success for r in results],
        "errors": [r.error for r in results],
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.output_tokens for r in results],
        "output_lens_from_usage": [r.output_tokens_from_usage for r in results],
        "requested_output_lens": [q.output_len for q in requests],
        "start_times": [r.start - t0 for r in results],
        "ttfts": [r.ttft for r in results],
        "tpots": [r.tpot for r in results],
        "itls": [r.itl for r in results],
        "e2els": [r.e2el for r in results],
        "generated_texts": [r.generated_text for r in results],
    }
    return _clean(doc)


def default_filename(model: str, request_rate: float, max_concurrency: int | None, date: datetime) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model) or "model"
    rate = "inf" if math.isinf(request_rate) else f"{request_rate:g}"
    conc = f"-concurrency{max_concurrency}" if max_concurrency else ""
    return f"bench-serve-{safe}-{rate}qps{conc}-{date.strftime('%Y%m%d-%H%M%S')}.json"


def write_result(doc: dict, result_dir: str | None, filename: str | None, default: str) -> Path:
    path = Path(result_dir or ".") / (filename or default)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    return path
