"""Issue 5's equivalences on the cuda backend, on the GPU (CUDA graphs on, NIXL over VRAM).

Tiny models with the serving attention dims, bf16 weights, fp8 caches:

* disaggregated (prefill worker -> NIXL VRAM push -> decode worker) greedy
  output == monolithic greedy output, with and without MTP;
* seeded sampling is reproducible, and the same through PD;
* aborts at every phase leave both pools at their starting free counts.

(The cuda backend against transformers / the reference backend is the
teacher-forced test in tests/attention/test_cuda_backend.py; MTP == plain on
the cuda backend is test_llm_cuda_mtp_greedy_equals_plain_gpu there.)
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.gpu

SERVING_DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128, index_n_heads=64,
                    num_attention_heads=16, index_topk=64)
LENGTHS = (1, 64, 65, 128, 150, 9, 300)
KW = dict(backend="cuda", device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", num_pages=128, chunk_size=64)


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def model(request, tmp_path_factory):
    from models.tiny import make_tiny

    return make_tiny(request.param, tmp_path_factory.mktemp(request.param), seed=5, **SERVING_DIMS)


def prompts():
    return [[40 + (i * 7 + j * 13) % 80 for j in range(n)] for i, n in enumerate(LENGTHS)]


def first_divergence(a, b):
    return [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None) for p, q in zip(a, b)]


@pytest.mark.parametrize("k", [0, 2])
def test_pd_equals_monolithic_cuda_gpu(model, k):
    from workers.offline import LLM

    mono = LLM(model, mtp_draft_tokens=k, **KW).generate(prompts(), max_new_tokens=16, ignore_eos=True)
    llm = LLM(model, pd=True, mtp_draft_tokens=k, **KW)
    got = llm.generate(prompts(), max_new_tokens=16, ignore_eos=True)
    st = llm.stats()
    print(f"PD {model.name} k={k}: equal={got == mono} first_divergence={first_divergence(got, mono)} "
          f"graph replays={sum(g.replays for g in llm.runner.decode_graphs.values())} stats={st}")
    assert got == mono
    assert st["pool_free_pages"] == st["pool_total_pages"] == st["prefill_pool_free_pages"]


def test_seeded_sampling_reproducible_cuda_gpu(model):
    from workers.offline import LLM

    kw = dict(max_new_tokens=12, temperature=0.8, top_k=40, seed=11, ignore_eos=True)
    a = LLM(model, **KW).generate(prompts()[:4], **kw)
    b = LLM(model, **KW).generate(prompts()[:4], **kw)
    c = LLM(model, pd=True, **KW).generate(prompts()[:4], **kw)
    print(f"SAMPLING {model.name}: rerun equal={a == b} pd equal={a == c}")
    assert a == b == c


def test_pd_aborts_at_every_phase_cuda_gpu(model):
    from workers.offline import LLM
    from workers.prefill_worker import PrefillTask
    from workers.request import Request
    from workers.sampler import SamplingParams

    llm = LLM(model, pd=True, **{**KW, "num_pages": 32, "chunk_size": 32})
    pre, dec = llm.pd.prefill, llm.pd.decode
    p_start, d_start = pre.pool.free_count, dec.pool.free_count
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)

    def start(rid, n):
        r = Request(rid, prompts()[-1][:n], params)
        pages = dec.reserve(r, pre.link.agent.name)
        pre.submit(PrefillTask(rid, r.prompt, params, dec.link.agent.name, pages))
        return r

    def pump(times=1):
        for _ in range(times):
            for res in pre.step():
                dec.on_prefill_result(res)
            dec.step()

    start("q0", 100)                  # queued
    assert dec.abort("q0")
    pump(3)
    start("m1", 100)                  # mid-prefill
    pump(1)
    dec.abort("m1")
    pump(3)
    start("t2", 20)                   # mid-transfer: prefill's answer is lost
    for _ in pre.step():
        pass
    assert dec.abort("t2")
    pump(3)
    r3 = start("d3", 20)              # mid-decode
    for _ in range(400):
        pump(1)
        if len(r3.output) >= 2:
            break
        time.sleep(0.01)
    assert len(r3.output) >= 2 and not r3.finished
    assert dec.abort("d3")
    deadline = time.monotonic() + 30  # held pages return once prefill settles
    while (pre.pool.free_count, dec.pool.free_count) != (p_start, d_start) and time.monotonic() < deadline:
        pump(1)
        time.sleep(0.01)
    assert (pre.pool.free_count, dec.pool.free_count) == (p_start, d_start)
