"""Talk to a running dsa-pd server with the official openai client (GPU smoke).

    python bench/openai_client_smoke.py [--base-url http://localhost:8000/v1]
Completions and chat, streaming and not, two concurrent clients, and one
bad-input case; prints what came back.
"""

from __future__ import annotations

import argparse
import concurrent.futures

import openai


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://localhost:8000/v1")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="none")
    model = client.models.list().data[0].id
    c = client.completions.create(model=model, prompt="Hello, sparse attention", max_tokens=16, temperature=0)
    print("completion:", repr(c.choices[0].text), c.usage)
    s = "".join(ch.choices[0].text for ch in client.completions.create(
        model=model, prompt="Hello, sparse attention", max_tokens=16, temperature=0, stream=True))
    print("streamed completion equals non-streamed:", s == c.choices[0].text)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0)
    print("chat:", repr(chat.choices[0].message.content), chat.choices[0].finish_reason)
    parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0, stream=True)]
    print("streamed chat equals non-streamed:", "".join(parts) == chat.choices[0].message.content)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda i: client.completions.create(
            model=model, prompt=f"request {i}", max_tokens=8, temperature=0).choices[0].text, range(4)))
    print("4 concurrent completions:", outs)
    try:
        client.completions.create(model=model, prompt="x", max_tokens=4, temperature=-1)
    except openai.BadRequestError as e:
        print("bad temperature ->", e.status_code, e.body.get("message") if isinstance(e.body, dict) else e.body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
