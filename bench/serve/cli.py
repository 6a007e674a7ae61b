"""``dsa-pd bench serve``: arguments (named as ``vllm bench serve``'s) and the run.

Imports only the standard library at module level, so that building the
``dsa-pd`` parser stays cheap; the run imports httpx and the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from datetime import datetime


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None,
                   help="server root, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT); a trailing /v1 is fine")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions (default) or /v1/chat/completions (text prompts only)")
    g.add_argument("--model", default=None, help="model name in the requests (default: the first of GET /v1/models)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, if set)")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may wait for its next bytes (connect: at most 30 s) before it fails")

    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", default="random",
                   choices=["random", "fixed", "jsonl", "prefix_repetition", "multi_turn"],
                   help="prefix_repetition / multi_turn: prompts that repeat prefixes (bench/serve/prefix_workloads.py)")
    g.add_argument("--dataset-path", default=None,
                   help='jsonl: one {"prompt": TEXT or [TOKEN IDS], "output_len": N (optional)} per line')
    g.add_argument("--num-prompts", type=int, default=None,
                   help="requests in the timed run (default 1000; jsonl: every line)")
    g.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens (random, fixed)")
    g.add_argument("--random-output-len", type=int, default=128,
                   help="output tokens asked for (random, fixed; jsonl lines without output_len)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: input and output lengths uniform in [L*(1-r), L*(1+r)]")
    g.add_argument("--random-vocab-size", type=int, default=256,
                   help="random/fixed token ids are drawn from [offset, offset + this) (default 256: the tiny "
                        "models' byte tokens, no special id)")
    g.add_argument("--random-token-offset", type=int, default=0, help="lowest random token id")
    g.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256,
                   help="prefix_repetition: tokens of each shared prefix")
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256,
                   help="prefix_repetition: tokens after the prefix, different in every request")
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10,
                   help="prefix_repetition: distinct prefixes (request i uses prefix i mod this)")
    g.add_argument("--prefix-repetition-output-len", type=int, default=128,
                   help="prefix_repetition: output tokens asked for")
    g.add_argument("--multi-turn-turns", type=int, default=4,
                   help="multi_turn: turns per conversation (turn 1: --random-input-len tokens)")
    g.add_argument("--multi-turn-user-len", type=int, default=64,
                   help="multi_turn: tokens each later turn adds after a --random-output-len stand-in reply")

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival times (1: Poisson; < 1 burstier, > 1 more regular)")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    g.add_argument("--num-warmups", type=int, default=0, help="untimed requests sent (and awaited) before the run: the dataset's kind and "
                   "shapes from another seed, so that none shares a prompt with the timed ones")

    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (every request runs to its max_tokens)")
    g.add_argument("--extra-body", default=None, help="a JSON object merged into every request body")

    g = p.add_argument_group("report")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="comma-separated, of ttft,tpot,itl,e2el (default ttft,tpot,itl)")
    g.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:5000: goodput counts requests meeting all")
    g.add_argument("--save-result", action="store_true", help="write the JSON result")
    g.add_argument("--result-dir", default=None, help="directory of the JSON result (default .)")
    g.add_argument("--result-filename", default=None,
                   help="file name (default bench-serve-MODEL-RATEqps[-concurrencyN]-DATE.json)")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def _metrics_list(text: str) -> list[str]:
    from bench.serve.metrics import METRICS

    names = [m.strip().lower() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics takes a comma-separated list of {','.join(METRICS)}, not {text!r}")
    return names


def _percentiles(text: str) -> list[float]:
    try:
        qs = [float(q) for q in text.split(",") if q.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles takes comma-separated numbers, not {text!r}") from None
    if not qs or any(not 0 <= q <= 100 for q in qs):
        raise ValueError(f"--metric-percentiles must be in [0, 100], not {text!r}")
    return qs


def server_root(args) -> str:
    """``--base-url`` (or http://HOST:PORT) without a trailing ``/`` or ``/v1``."""
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    return base.removesuffix("/v1")


def endpoint_url(args) -> str:
    endpoint = args.endpoint if args.endpoint.startswith("/") else "/" + args.endpoint
    return server_root(args) + endpoint


async def _first_model(http, root: str, headers: dict) -> str:
    import httpx

    try:
        resp = await http.get(root + "/v1/models", headers=headers)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"no --model given and GET {root}/v1/models did not name one ({type(e).__name__}: {e})") from None


async def run_benchmark(args, transport=None) -> tuple[dict, dict]:
    """Run the benchmark of parsed ``args``; (summary, JSON document). ``transport``:
    an httpx transport to use instead of the network (tests)."""
    import httpx

    from bench.serve.client import is_chat, request_body, send_request
    from bench.serve.datasets import build_requests, warm_up_requests
    from bench.serve.loadgen import run_load, warm_up
    from bench.serve.metrics import parse_goodput, summarize
    from bench.serve.progress import Progress
    from bench.serve.report import (
        default_filename,
        format_table,
        result_document,
        write_result,
    )

    metrics = _metrics_list(args.percentile_metrics)
    percentiles = _percentiles(args.metric_percentiles)
    slos = parse_goodput(args.goodput)
    extra = json.loads(args.extra_body) if args.extra_body else None
    if extra is not None and not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.request_timeout <= 0:
        raise ValueError("--request-timeout must be > 0")
    requests = build_requests(args)
    chat = is_chat(args.endpoint)
    url = endpoint_url(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    timeout = httpx.Timeout(args.request_timeout, connect=min(30.0, args.request_timeout))
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as http:
        model = args.model or await _first_model(http, server_root(args), headers)
        def body(q):
            return request_body(q, model=model, chat=chat, temperature=args.temperature,
                                ignore_eos=args.ignore_eos, extra_body=extra)

        bodies = {id(q): body(q) for q in requests}

        async def send(q):
            # A warm-up copy of a multi-turn request (its `follows` dropped) is not in ``bodies``.
            b = bodies.get(id(q)) or body(q)
            return await send_request(http, url, b, chat=chat, prompt_len=q.prompt_len, headers=headers)

        print(f"bench serve: {len(requests)} requests ({args.dataset_name}) to {url}, model {model}, "
              f"rate {args.request_rate:g}/s, max concurrency {args.max_concurrency or 'unlimited'}",
              file=sys.stderr)
        if args.num_warmups > 0:
            bar = Progress(args.num_warmups, "warm-up", disable=args.disable_tqdm)
            warm = await warm_up(warm_up_requests(args), send, args.num_warmups, args.max_concurrency, bar)
            bar.close()
            bad = [r.error for r in warm if not r.success]
            print(f"warm-up: {len(warm)} requests, {len(bad)} failed" + (f" (first: {bad[0]})" if bad else ""),
                  file=sys.stderr)
        bar = Progress(len(requests), "requests", disable=args.disable_tqdm)
        results, duration = await run_load(requests, send, request_rate=args.request_rate,
                                           burstiness=args.burstiness, seed=args.seed,
                                           max_concurrency=args.max_concurrency, progress=bar)
        bar.close()

    summary = summarize(results, duration, metrics=metrics, percentiles=percentiles, goodput_slos_ms=slos)
    print(format_table(summary, metrics=metrics, percentiles=percentiles, max_concurrency=args.max_concurrency,
                       request_rate=args.request_rate, results=results))
    date = datetime.now()
    config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key") and not callable(v)}
    doc = result_document(summary=summary, results=results, requests=requests, config=config, model=model,
                          url=url, goodput_slos_ms=slos, date=date)
    if args.save_result:
        path = write_result(doc, args.result_dir, args.result_filename,
                            default_filename(model, args.request_rate, args.max_concurrency, date))
        print(f"saved the result to {path}", file=sys.stderr)
    return summary, doc


def run(args) -> int:
    """Exit status: 0 when the run finished with at least one successful request, 1 when every request failed."""
    summary, _ = asyncio.run(run_benchmark(args))
    return 0 if summary["completed"] > 0 else 1


def main(argv: list[str] | None = None) -> int:
    p = add_arguments(argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__))
    args = p.parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
