"""`serve run` of a tensor-parallel 2 PD config on four GPUs (``nvidia-h200-x4``), cuda backend.

``configs/tiny_pd_gpu.yaml`` (tiny model with serving attention dims, bf16, fp8 caches, MTP 1) with
``tensor_parallel_size: 2`` on both roles: each replica reserves a
placement group of two one-GPU bundles, prefill rank i pushes to decode rank i over NIXL in VRAM.
Answered through the official openai client: greedy completions, streamed and not, concurrent,
have their token counts, a request alone gives the same text streamed and not, and both pools
come back whole. The greedy agreement with the offline one-GPU engine is printed (bf16 sums of a
two-rank all-reduce differ by rounding, so equality is not the criterion; the teacher-forced
tolerance of tp 2 is `tests/workers/test_tensor_parallel_gpu.py`'s).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.deployments.app_fixtures import merged, yaml_args

pytestmark = pytest.mark.gpu

RAW = merged(yaml_args("tiny_pd_gpu.yaml"),
             prefill={"tensor_parallel_size": 2, "num_gpus": 2, "num_cpus": 1},
             decode={"tensor_parallel_size": 2, "num_gpus": 2, "num_cpus": 1})
PROMPTS = [[40 + (i * 7 + j * 13) % 80 for j in range(n)] for i, n in enumerate((5, 70, 150, 260, 33, 900))]
TOKENS = 24


def test_tp2_pd_serves_on_four_gpus(tmp_path):
    import openai

    from deployments.app_config import AppConfig
    from tests.deployments.serve_process import offline_greedy_texts, shared_cache_dir, stats, wait_until
    from tests.deployments.shared_servers import ServerSpec

    if torch.cuda.device_count() < 4:
        pytest.fail(f"tp 2 on both roles runs 4 rank workers: needs 4 GPUs, found {torch.cuda.device_count()}")
    args = AppConfig.model_validate(RAW)
    # One GPU, eager (tp 1): the reference the two-rank server is compared with.
    want_text = offline_greedy_texts(args, shared_cache_dir(), PROMPTS, TOKENS, num_pages=256, chunk_size=1024,
                                     cuda_graphs=False)

    server = ServerSpec("serve-tp2-gpu", args=RAW, config_name="tiny_pd_gpu_tp2.yaml").start(tmp_path)
    try:
        server.wait_ready(timeout=540)
        assert server.log().count("2 rank workers started") == 2, server.tail(80)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)

        def one(i: int, stream: bool = False) -> tuple[str, int | None]:
            kw = dict(model=args.model_name, prompt=PROMPTS[i], max_tokens=TOKENS, temperature=0,
                      extra_body={"ignore_eos": True})
            if not stream:
                r = client.completions.create(**kw)
                return r.choices[0].text, r.usage.completion_tokens
            text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
            return text, None

        alone = [one(i) for i in range(len(PROMPTS))]
        streamed = [one(i, stream=True)[0] for i in range(len(PROMPTS))]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(one, range(len(PROMPTS))))
        agree = sum(a == w for (a, _), w in zip(alone, want_text))
        print(f"served tp 2 vs offline tp 1: {agree} of {len(PROMPTS)} greedy texts equal; "
              f"concurrent == alone: {sum(t == a for t, a in zip(together, alone))} of {len(PROMPTS)}")
        assert all(n == TOKENS for _, n in alone + together), (alone, together)
        assert streamed == [a for a, _ in alone]
        # Every page back but decode's warm-up page (prefill replicas write their warm-up WRITE into it).
        whole = (args.prefill.num_pages, args.decode.num_pages - 1)
        wait_until(lambda: (stats(server)["prefill"][0]["stats"]["free_pages"],
                            stats(server)["decode"][0]["stats"]["free_pages"]) == whole, 60, "both pools whole")
    finally:
        server.stop()
