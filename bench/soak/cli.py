"""``dsa-pd bench soak``: arguments, the run, the verdict.

The verdict (exit status 0 only if all hold): no unexpected answer (`bench.soak.load`), every page
pool back at its start count once the load ended (free pages = total, less decode's warm-up page),
and no process's resident memory grown by more than ``--max-growth-mib`` between the first and the
last quarter of the samples after ``--warmup`` seconds (`bench.soak.memory`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default %(default)s)")
    p.add_argument("--model", default=None, help="model name in the requests (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, if set)")
    p.add_argument("--vocab-size", type=int, default=256,
                   help="token ids of the random prompts are below this (default %(default)s; the tiny models have 320)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default %(default)s)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (default %(default)s)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(8, 256), metavar=("MIN", "MAX"),
                   help="token-id prompt lengths, uniform (default 8 256)")
    p.add_argument("--output-len", type=int, nargs=2, default=(1, 64), metavar=("MIN", "MAX"),
                   help="max_tokens, uniform (default 1 64)")
    p.add_argument("--weights", default=None,
                   help='JSON {kind: weight} over stream, chat, nonstream, cancel, bad (default '
                        '{"stream": 4, "chat": 2, "nonstream": 1, "cancel": 2, "bad": 1})')
    p.add_argument("--warmup", type=float, default=60.0,
                   help="seconds after the start whose memory samples do not count (default %(default)s)")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between memory samples (default %(default)s)")
    p.add_argument("--max-growth-mib", type=float, default=64.0,
                   help="most a process's RSS may grow after the warm-up (default %(default)s)")
    p.add_argument("--settle", type=float, default=60.0,
                   help="seconds the pools get to come back after the load (default %(default)s)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", default=None, help="write the whole result (memory series included) as JSON here")
    return p


def run(args) -> int:
    result = asyncio.run(soak(args))
    print(json.dumps({k: v for k, v in result.items() if k != "memory_series"}, indent=2))
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["passed"] else 1


async def soak(args) -> dict:
    """The whole soak; returns its result (see the module doc for ``passed``)."""
    import httpx

    from bench.soak.load import Mix, run_clients
    from bench.soak.memory import MemorySeries

    base = args.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=30) as http:
        model = args.model or (await http.get("/v1/models")).json()["data"][0]["id"]
        start_stats = await _stats(http)
        memory = MemorySeries()
        memory.sample(start_stats)
        mix = Mix(tuple(args.prompt_len), tuple(args.output_len),
                  json.loads(args.weights) if args.weights else Mix().weights)
        clients = asyncio.create_task(run_clients(
            base, model, args.vocab_size, clients=args.clients, duration_s=args.duration, mix=mix, seed=args.seed,
            headers=headers, request_timeout=args.request_timeout))
        while not clients.done():
            await asyncio.wait([clients], timeout=args.sample_every)
            try:
                memory.sample(await _stats(http))
            except httpx.HTTPError:
                pass  # counted by the clients if the server is really gone
        record = clients.result()
        load_s = round(time.monotonic() - memory.start, 1)
        pools = await _settled_pools(http, args.settle)
    growth = memory.growth(args.warmup)
    grown = {name: g for name, g in growth.items() if g["growth_mib"] > args.max_growth_mib}
    leaked = sum(p["leaked"] for p in pools)
    return {
        "model": model, "clients": args.clients, "duration_s": args.duration, "load_s": load_s,
        "warmup_s": args.warmup,
        "requests": record.table(), "tokens": record.tokens,
        "unexpected": len(record.unexpected), "unexpected_detail": record.unexpected[:50],
        "pools": pools, "leaked_pages": leaked,
        "memory_growth": growth, "memory_grown": sorted(grown),
        "passed": not record.unexpected and leaked == 0 and not grown,
        "memory_series": memory.samples,
    }


async def _stats(http) -> dict:
    r = await http.get("/stats")
    r.raise_for_status()
    return r.json()


async def _settled_pools(http, settle_s: float) -> list[dict]:
    """Each replica's pool once every page came back, or as it stands after ``settle_s`` seconds:
    ``leaked`` = pages still out (requests end after their last answer; decode holds a request's
    pages until its prefill settles)."""
    end = time.monotonic() + settle_s
    while True:
        s = await _stats(http)
        pools = []
        for role in ("prefill", "decode"):
            for e in s.get(role, []):
                st = e["stats"]
                whole = st["total_pages"] - st.get("reserved_pages", 0)
                pools.append({"role": role, "agent": e["agent"], "free_pages": st["free_pages"],
                              "whole": whole, "leaked": whole - st["free_pages"]})
        if all(p["leaked"] == 0 for p in pools) or time.monotonic() > end:
            return pools
        await asyncio.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dsa-pd bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
