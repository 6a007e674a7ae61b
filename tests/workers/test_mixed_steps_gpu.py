"""Mixed steps on the GPU: the decode batch rides along with arriving prompts' rows-graph prefill
(`Engine._prefill`) under captured CUDA graphs, on the cuda backend (bf16 weights, fp8 caches, FlashMLA,
DeepGEMM's paged indexer). The steps that could mix did, every request finished and freed its pages, and the
outputs are the plain engine's (each prompt alone, graphs off) but for bf16 rounding: the rows of a mixed
step are GEMM rows of a wider product. The exact equality is the CPU test's (tests/workers/test_mixed_steps.py).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

SERVING_DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128, index_n_heads=64,
                    num_attention_heads=16, index_topk=256)
NEW = 16


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_decode_rides_along_on_the_gpu(arch, tmp_path):
    from models.tiny import make_tiny
    from tests.workers.mixed_arrivals import drive_arrivals
    from tests.workers.prompts import random_prompt
    from workers.offline import LLM

    model = make_tiny(arch, tmp_path / arch, seed=6, **SERVING_DIMS)
    kw = dict(backend="cuda", device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", num_pages=128,
              chunk_size=512, max_batch_size=8)
    base = random_prompt(300, 300, 3)
    early = [random_prompt(n, 300, 70 + n) for n in (20, 45)]
    late = [random_prompt(30, 300, 8), base + random_prompt(12, 300, 9)]
    together = [base + random_prompt(m, 300, 190 + m) for m in (3, 30)]

    plain = LLM(model, cuda_graphs=False, **kw)
    plain.generate([base], max_new_tokens=1, ignore_eos=True)
    want = [plain.generate([p], max_new_tokens=NEW, ignore_eos=True)[0] for p in early + late + together]
    del plain

    llm = LLM(model, cuda_graphs=True, prefill_graph_max_tokens=256, **kw)
    llm.generate([base], max_new_tokens=1, ignore_eos=True)
    reqs, mixed = drive_arrivals(llm.engine, early, late, together, NEW)
    got = [r.output for r in reqs]
    agreed = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), NEW) for g, w in zip(got, want)]
    print(f"MIXED {arch}: {mixed} mixed steps; tokens agreeing with the plain engine "
          f"before the first difference: {agreed} of {NEW}")
    assert mixed == 2  # the prefix hit's step and the two hits' step
    assert all(len(g) == NEW for g in got)
    assert llm.pool.free_count == llm.pool.num_pages
    # The first tokens come from each prompt's own prefill: a mixed step must not disturb them.
    assert sum(a >= 1 for a in agreed) >= len(agreed) - 1, agreed
