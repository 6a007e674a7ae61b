"""Greedy token ids from a running OpenAI-compatible server, for the greedy agreement.

Sends ``bench.offline.random_prompts(B, --input-len, --seed)`` as token-id prompts, all ``B`` at
once (the server batches them as it likes), greedy, ``--output-len`` tokens, EOS ignored, and asks
for the output's ids (``return_token_ids``: vLLM's field, which dsa-pd's ingress answers too).
Writes ``--json`` in the shape ``bench/peers/agreement.py`` reads (the cases of ``dsa-pd bench
offline``), so two servers' results compare token by token without starting either engine's
offline mode: the servers already up for the load rows answer it.

    python -m bench.peers.served_greedy --base-url http://127.0.0.1:8000 --json ours.json
"""

from __future__ import annotations

import argparse
import asyncio
import json

from bench.offline import random_prompts


async def _one(client, url: str, model: str, prompt: list[int], n: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    r = await client.post(url + "/v1/completions", json=body)
    if r.status_code != 200:
        raise SystemExit(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
    ids = r.json()["choices"][0].get("token_ids")
    if ids is None:
        raise SystemExit(f"{url}: the response has no token_ids (a server without return_token_ids)")
    return ids


async def greedy_cases(base_url: str, model: str, batch_sizes: list[int], input_len: int, output_len: int,
                       seed: int, timeout_s: float = 600.0) -> list[dict]:
    """One case per batch size: its prompts' greedy ids, sent concurrently."""
    import httpx

    cases = []
    limits = httpx.Limits(max_connections=max(batch_sizes))
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        for b in batch_sizes:
            prompts = random_prompts(b, input_len, seed)
            ids = await asyncio.gather(*(_one(client, base_url, model, p, output_len) for p in prompts))
            cases.append({"batch": b, "input_len": input_len, "output_len": output_len, "token_ids": list(ids)})
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", default="peer-model")
    ap.add_argument("--batch-sizes", nargs="*", type=int, default=[1, 32])
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    cases = asyncio.run(greedy_cases(args.base_url.rstrip("/"), args.model, args.batch_sizes, args.input_len,
                                     args.output_len, args.seed))
    with open(args.json, "w") as f:
        json.dump({"base_url": args.base_url, "seed": args.seed, "cases": cases}, f)
    print(f"{args.base_url}: " + ", ".join(f"batch {c['batch']}: {len(c['token_ids'])} outputs" for c in cases))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
