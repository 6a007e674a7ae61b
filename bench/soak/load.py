"""The soak's clients: a fixed number of concurrent clients, each sending one request after another
from a weighted mix until the time is up, every answer judged as expected or not.

Kinds (``KINDS``):

* ``stream``: a streamed completion of a token-id prompt (random length) with ``ignore_eos``;
  expected: every token asked for, a ``finish_reason``, ``[DONE]``.
* ``chat``: a streamed chat completion of a short text message; expected: a finished stream.
* ``nonstream``: a completion answered in one body; expected: 200 with ``max_tokens`` tokens.
* ``cancel``: a streamed completion the client drops: before the answer (after a random delay) or
  after a random number of chunks; expected: nothing (the server frees what it held).
* ``bad``: one of ``BAD_BODIES``; expected: its 4xx status with an OpenAI error object.

A 429 (``overloaded``) is expected anywhere (backpressure, counted apart); anything else (a 5xx,
a broken stream, a timeout, a bad body accepted) is an *unexpected* error, listed with its detail.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from bench.serve.client import error_message, send_request

KINDS = ("stream", "chat", "nonstream", "cancel", "bad")
DEFAULT_WEIGHTS = {"stream": 4, "chat": 2, "nonstream": 1, "cancel": 2, "bad": 1}


def bad_bodies(model: str, vocab_size: int) -> list[tuple[str, bytes, int]]:
    """(name, raw body for /v1/completions, the status it must get)."""
    ok = {"model": model, "prompt": [1, 2, 3], "max_tokens": 4}

    def body(**over) -> bytes:
        return json.dumps({**ok, **over}).encode()

    return [
        ("negative max_tokens", body(max_tokens=-1), 400),
        ("unknown field", body(frobnicate=1), 400),
        ("wrong model", body(model=model + "-nope"), 404),
        ("token id outside the vocabulary", body(prompt=[1, vocab_size]), 400),
        ("NaN temperature", json.dumps(ok)[:-1].encode() + b', "temperature": NaN}', 400),
        ("not JSON", b'{"model": ', 400),
        ("not UTF-8", b'{"model": "caf\xe9"}', 400),
        ("empty prompt", body(prompt=[]), 400),
    ]


@dataclass
class SoakRecord:
    """What the clients saw: counts by (kind, outcome), and every unexpected answer's detail."""

    counts: Counter = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    tokens: int = 0

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        self.counts[(kind, outcome)] += 1
        if outcome == "unexpected":
            self.unexpected.append(f"{kind}: {detail}")

    def table(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (kind, outcome), n in sorted(self.counts.items()):
            out.setdefault(kind, {})[outcome] = n
        return out


@dataclass(frozen=True)
class Mix:
    prompt_len: tuple[int, int] = (8, 256)
    output_len: tuple[int, int] = (1, 64)
    weights: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))


async def run_clients(base_url: str, model: str, vocab_size: int, *, clients: int, duration_s: float, mix: Mix,
                      seed: int, headers: dict[str, str], request_timeout: float) -> SoakRecord:
    """``clients`` concurrent clients for ``duration_s`` seconds; a request in flight at the end is let finish."""
    record = SoakRecord()
    end = time.monotonic() + duration_s
    kinds = [k for k in KINDS if mix.weights.get(k, 0) > 0]
    weights = [mix.weights[k] for k in kinds]
    bad = bad_bodies(model, vocab_size)
    timeout = httpx.Timeout(request_timeout, connect=30.0)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as http:
        async def client(c: int) -> None:
            rng = random.Random(seed * 1000 + c)
            while time.monotonic() < end:
                kind = rng.choices(kinds, weights)[0]
                try:
                    await _one(http, kind, rng, model, vocab_size, mix, bad, headers, record)
                except Exception as e:  # noqa: BLE001 - a client bug or a transport error: counted, never fatal
                    record.add(kind, "unexpected", f"{type(e).__name__}: {e}")

        await asyncio.gather(*(client(c) for c in range(clients)))
    return record


def _prompt(rng: random.Random, mix: Mix, vocab_size: int) -> list[int]:
    n = rng.randint(*mix.prompt_len)
    return [rng.randrange(1, vocab_size) for _ in range(n)]


async def _one(http: httpx.AsyncClient, kind: str, rng: random.Random, model: str, vocab_size: int, mix: Mix,
               bad: list, headers: dict[str, str], record: SoakRecord) -> None:
    max_tokens = rng.randint(*mix.output_len)
    completion = {"model": model, "prompt": _prompt(rng, mix, vocab_size), "max_tokens": max_tokens,
                  "temperature": rng.choice([0.0, 0.7]), "seed": rng.randrange(1 << 30), "ignore_eos": True}
    if kind in ("stream", "chat"):
        if kind == "chat":
            body = {"model": model, "messages": [{"role": "user", "content": f"soak message {rng.randrange(10**6)}"}],
                    "max_completion_tokens": max_tokens, "temperature": 0.7}
        else:
            body = completion
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        r = await send_request(http, "/v1/chat/completions" if kind == "chat" else "/v1/completions", body,
                               chat=kind == "chat", headers=headers)
        if r.success and (kind == "chat" or r.output_tokens == max_tokens):
            record.tokens += r.output_tokens
            record.add(kind, "ok")
        elif r.error.startswith("HTTP 429"):
            record.add(kind, "overloaded")
        else:
            record.add(kind, "unexpected", r.error or f"{r.output_tokens} tokens of {max_tokens}")
    elif kind == "nonstream":
        resp = await http.post("/v1/completions", json=completion, headers=headers)
        if resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == max_tokens:
            record.tokens += max_tokens
            record.add(kind, "ok")
        elif resp.status_code == 429:
            record.add(kind, "overloaded")
        else:
            record.add(kind, "unexpected", error_message(resp.status_code, resp.content))
    elif kind == "cancel":
        await _cancelled(http, {**completion, "stream": True}, rng, headers, record)
    else:
        name, raw, want = rng.choice(bad)
        resp = await http.post("/v1/completions", content=raw, headers={**headers, "content-type": "application/json"})
        shaped = _is_openai_error(resp)
        if resp.status_code == want and shaped:
            record.add(kind, "ok")
        else:
            record.add(kind, "unexpected", f"{name}: got {resp.status_code} (want {want}), "
                                           f"{'an' if shaped else 'no'} OpenAI error object: {resp.text[:200]}")


async def _cancelled(http: httpx.AsyncClient, body: dict, rng: random.Random, headers: dict[str, str],
                     record: SoakRecord) -> None:
    """Drop a streamed request: before its answer (a random delay up to 0.5 s: mid-prefill or mid-push), or
    after 1-3 chunks (mid-decode)."""
    chunks = rng.randint(0, 3)
    try:
        if chunks == 0:
            async with asyncio.timeout(rng.uniform(0.0, 0.5)):
                async with http.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
                    await resp.aread()
            outcome = "finished first"  # done before the client left: nothing to cancel
        else:
            async with http.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    content = await resp.aread()
                    if resp.status_code == 429:
                        record.add("cancel", "overloaded")
                    else:
                        record.add("cancel", "unexpected", error_message(resp.status_code, content))
                    return
                seen = 0
                async for line in resp.aiter_lines():
                    if line.startswith("data:"):
                        seen += 1
                        if seen >= chunks:
                            break
            outcome = "cancelled"
    except TimeoutError:
        outcome = "cancelled"
    record.add("cancel", outcome)


def _is_openai_error(resp: httpx.Response) -> bool:
    try:
        err = resp.json()["error"]
        return isinstance(err, dict) and bool(err.get("message")) and "type" in err
    except (ValueError, KeyError, TypeError):
        return False
