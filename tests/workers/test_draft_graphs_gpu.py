"""MTP drafts through CUDA graphs on the GPU (`workers.draft_graphs`): every replayed draft equals
the same draft run eagerly on the same static-buffer code, bit for bit, and the draft phase never
waits for the device (the drafts stay there until the verify's one read-back).

Tiny models with the serving attention dims on the cuda backend, bf16 weights, fp8 caches, as
tests/workers/test_decode_graphs_gpu.py (which checks the verify's graphs: with MTP on it now runs
the draft graphs too). Requests of different prompt and output lengths make the batch grow and
shrink (buckets change, rows move). For each draft phase the engine replays, the same inputs then
run through an eager `DraftGraphs` (``capture=False``) over its own rows and page tables: the logits
of every draft forward and the drafts must be identical (the eager run rewrites the same MTP cache
bytes). MTP greedy == plain greedy with graphs on is test_llm_cuda_mtp_greedy_equals_plain_gpu
(tests/attention/test_cuda_backend.py).

Run: python -m pytest -q -m gpu tests/workers/test_draft_graphs_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from tests.workers.graph_workload import PROMPTS, generate_mixed

pytestmark = pytest.mark.gpu

SERVING_DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128, index_n_heads=64,
                    num_attention_heads=16, index_topk=64)


@pytest.mark.parametrize("arch,k,reuse", [("deepseek_v32", 1, False), ("deepseek_v32", 2, True),
                                          ("glm_moe_dsa", 3, False)])
def test_draft_graph_replay_equals_eager_gpu(arch, k, reuse, tmp_path):
    from tests.workers.mtp_friendly import make_mtp_friendly
    from workers.decode_graphs import DecodeGraphs
    from workers.draft_graphs import DraftGraphs
    from workers.mtp_draft import DraftSampler
    from workers.offline import LLM

    # Drafts that are often right, so acceptance of 0..k drafts runs.
    model = make_mtp_friendly(arch, tmp_path / arch, **SERVING_DIMS)
    kw = dict(backend="cuda", device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", num_pages=256,
              chunk_size=256, max_batch_size=8, mtp_draft_tokens=k, mtp_topk_reuse=reuse)
    llm = LLM(model, cuda_graphs=True, **kw)
    graphs = llm.engine.drafter.graphs
    assert graphs is not None and graphs.capture
    assert set(graphs.graphs) == set(graphs.plan.batch_sizes) and all(len(g) == k for g in graphs.graphs.values())
    eager_rows = DecodeGraphs(llm.model, llm.cache, llm.runner.backend, graphs.plan, "cuda", capture=False)
    eager = DraftGraphs(llm.model, llm.cache, llm.runner.backend, eager_rows, k, reuse, capture=False)

    class Recording(DraftSampler):
        def __init__(self, meta):
            super().__init__(meta)
            self.seen = []

        def __call__(self, logits):
            self.seen.append(logits.clone())
            return super().__call__(logits)

    replay = graphs.run
    sizes, mismatches = [], []

    def checked_run(drafter, reqs, pending, sampler):
        last = drafter._last  # the verify's hidden states, taken by the first run
        got_s = Recording(sampler.meta)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # the draft phase must not wait for the device
        try:
            got = replay(drafter, reqs, pending, got_s)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        drafter._last = last
        want_s = Recording(sampler.meta)
        want = eager.run(drafter, reqs, pending, want_s)
        sizes.append(len(reqs))
        same = torch.equal(got.tokens, want.tokens) and all(torch.equal(a, b) for a, b in zip(got_s.seen, want_s.seen))
        if not same:
            mismatches.append((len(sizes), [float((a - b).abs().max()) for a, b in zip(got_s.seen, want_s.seen)]))
        return got

    graphs.run = checked_run
    prompts = PROMPTS
    outs = generate_mixed(llm)
    seeded = llm.generate(prompts[:4], max_new_tokens=12, temperature=0.8, top_k=50, seed=3, ignore_eos=True)
    assert not mismatches, mismatches[:5]
    assert graphs.replays == k * len(sizes) and len(sizes) >= 10, (graphs.replays, len(sizes))
    assert len(set(sizes)) >= 2, sizes
    assert llm.pool.free_count == llm.pool.num_pages
    st = llm.stats()
    assert st["mtp_accepted"] > 0, st
    # For the record (not asserted: bf16 GEMMs of other widths round differently): the ungraphed engine.
    plain = LLM(model, cuda_graphs=False, **kw)
    same = sum(a == b for a, b in zip(outs, plain.generate(prompts, max_new_tokens=24, ignore_eos=True)))
    same_seeded = plain.generate(prompts[:4], max_new_tokens=12, temperature=0.8, top_k=50, seed=3,
                                 ignore_eos=True) == seeded
    print(f"DRAFT GRAPHS {arch} k={k} reuse={reuse}: {len(sizes)} draft phases x {k} replays over batch sizes "
          f"{sorted(set(sizes))}, replay == eager; acceptance {st['mtp_acceptance_rate']:.2f} "
          f"{st['mtp_accepted_histogram']}; greedy outputs equal to the ungraphed engine for {same}/{len(outs)}, "
          f"seeded equal: {same_seeded}")

