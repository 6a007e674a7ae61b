"""`serve run configs/tiny_v4_pd_gpu.yaml` on one GPU: DeepSeek-V4 on the cuda backend, one prefill and one
decode replica sharing the GPU, every cache group's pages (sliding window, compressed entries, indexer
keys, compressor state) pushed over NIXL in VRAM (issue 22's "serve run of the tiny V4 config").

Answered through the official openai client. Greedy completions, one at a time, equal the offline
engine's on the same GPU (`LLM(pd=False)`, the decode role's dtype and KV format, the prefill role's
chunk size), token for token. The prompts cross the window, many compressed blocks, 256-token pages and
a 1,024-token chunk. Streamed equals non-streamed. Concurrent requests have their token counts, and
their agreement with the alone outputs is printed: batched bf16 sums may round differently, and V3.2's
batch invariance on this backend is `tests/workers/test_engine_cuda_gpu.py`'s. Both pools end where
they started.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.deployments.app_fixtures import yaml_args

pytestmark = pytest.mark.gpu

RAW = yaml_args("tiny_v4_pd_gpu.yaml")
PROMPTS = [[40 + (i * 7 + j * 13) % 80 for j in range(n)] for i, n in enumerate((5, 37, 260, 1300, 2000))]
TOKENS = 24


def test_tiny_v4_pd_serves_on_one_gpu(tmp_path):
    import openai

    from deployments.app_config import AppConfig
    from tests.deployments.app_fixtures import CONFIGS
    from tests.deployments.serve_process import ServeProcess, offline_greedy_texts, shared_cache_dir, stats, wait_until

    args = AppConfig.model_validate(RAW)
    want_text = offline_greedy_texts(args, shared_cache_dir(), PROMPTS, TOKENS, one_at_a_time=True,
                                     num_pages=args.decode.num_pages)

    server = ServeProcess(CONFIGS / "tiny_v4_pd_gpu.yaml", tmp_path).start()  # the shipped file, as users run it
    try:
        server.wait_ready(timeout=400)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)

        def one(i: int, stream: bool = False) -> tuple[str, int]:
            kw = dict(model=args.model_name, prompt=PROMPTS[i], max_tokens=TOKENS, temperature=0, logprobs=0,
                      extra_body={"ignore_eos": True})
            if not stream:
                r = client.completions.create(**kw)
                return r.choices[0].text, r.usage.completion_tokens
            chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
            return "".join(c.choices[0].text for c in chunks), sum(len(c.choices[0].logprobs.tokens) for c in chunks)

        alone = [one(i) for i in range(len(PROMPTS))]
        streamed = [one(i, stream=True) for i in range(len(PROMPTS))]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(one, range(len(PROMPTS))))
        print(f"served V4 PD vs offline: {sum(a == w for (a, _), w in zip(alone, want_text))} of {len(PROMPTS)} "
              f"equal alone; concurrent == alone: {sum(t == a for t, a in zip(together, alone))} of {len(PROMPTS)}")
        assert [a for a, _ in alone] == want_text
        assert all(n == TOKENS for _, n in alone + together + streamed), (alone, together, streamed)
        assert [s for s, _ in streamed] == [a for a, _ in alone]

        def whole() -> bool:
            s = stats(server)
            (p,), (d,) = s["prefill"], s["decode"]
            p, d = p["stats"], d["stats"]
            return p["free_pages"] == p["total_pages"] and d["requests"] == 0 \
                and d["free_pages"] == d["total_pages"] - d["reserved_pages"]

        wait_until(whole, 60, "both pools back at their start counts")
    finally:
        server.stop()
