"""CUDA-graph prefills on the GPU: every replayed prefill equals the same static-buffer prefill run eagerly.

A tiny model with the serving attention dims on the cuda backend (bf16 weights, fp8 caches, Triton
MoE, FlashMLA sparse prefill and decode, DeepGEMM's paged indexer). Prompts of many lengths go
through the engine one at a time, then prompts over a shared cached prefix: those that fit a bucket
replay its graph (a new prompt's, or a suffix's over the cached pages), which must give the same
hidden states, bit for bit, as the very same code run eagerly on the same inputs; the rest run
eagerly. Then several prompts over that prefix in one prefill step: one rows graph. Outputs against the plain
eager prefill are printed, not asserted (bf16 GEMMs over a padded row count round differently).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

SERVING_DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128, index_n_heads=64,
                    num_attention_heads=16, index_topk=256)
LENGTHS = (1, 15, 16, 40, 100, 129, 200, 256, 257, 300)


@pytest.mark.parametrize("arch,k", [("deepseek_v32", 0), ("deepseek_v32", 1), ("glm_moe_dsa", 0)])
def test_prefill_graph_replay_equals_eager_gpu(arch, k, tmp_path):
    from models.tiny import make_tiny
    from tests.workers.prompts import random_prompt
    from workers.offline import LLM
    from workers.prefill_graphs import PrefillGraphs

    model = make_tiny(arch, tmp_path / arch, seed=6, **SERVING_DIMS)
    kw = dict(backend="cuda", device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", num_pages=128,
              chunk_size=512, max_batch_size=4, mtp_draft_tokens=k)
    llm = LLM(model, cuda_graphs=True, prefill_graph_max_tokens=256, **kw)
    graphs = llm.runner.prefill_graphs
    assert graphs.plan.buckets == (16, 32, 64, 128, 256)
    assert set(graphs.graphs["prompt"]) == set(graphs.plan.buckets)
    assert set(graphs.graphs["rows"]) == set(graphs.plan.row_buckets) == {16, 32, 64, 128, 256}
    eager = PrefillGraphs(llm.model, llm.cache, llm.runner.backend, graphs.plan, "cuda", capture=False)
    replay = graphs.run
    served, mismatches = [], []

    def checked_run(items):
        batch, got = replay(items)
        got = got.clone()
        _, want = eager.run(items)
        served.append((graphs.plan.kind(items), tuple(len(it.token_ids) for it in items)))
        if not torch.equal(got, want):
            mismatches.append((served[-1], float((got.float() - want.float()).abs().max())))
        return batch, got

    graphs.run = checked_run
    prompts = [random_prompt(n, 300, 70 + n) for n in LENGTHS]
    # Then prompts over a shared cached prefix: base (300 tokens, eager) leaves 4 full pages cached (a
    # page's key covers the token after it); each prompt's suffix after them takes a rows graph.
    base = random_prompt(300, 300, 3)
    prompts += [base + random_prompt(m, 300, 90 + m) for m in (1, 20, 100, 200)]
    outs = [llm.generate([p], max_new_tokens=8, ignore_eos=True)[0] for p in prompts[:len(LENGTHS)]]
    llm.generate([base], max_new_tokens=2, ignore_eos=True)
    outs += [llm.generate([p], max_new_tokens=8, ignore_eos=True)[0] for p in prompts[len(LENGTHS):]]
    # And several requests in one prefill step (one rows graph): other suffixes over the same prefix.
    together = [base + random_prompt(m, 300, 190 + m) for m in (3, 30, 60)]
    outs_together = llm.generate(together, max_new_tokens=8, ignore_eos=True)
    assert not mismatches, mismatches
    assert sorted(ns[0] for k, ns in served if k == "prompt") == [n for n in LENGTHS if n <= 256], served
    assert [x for x in served if x[0] == "rows" and len(x[1]) == 1] == [("rows", (44 + m,)) for m in (1, 20, 100, 200)]
    assert ("rows", (47, 74, 104)) in served, served
    assert graphs.replays == len(served)
    assert llm.pool.free_count == llm.pool.num_pages
    plain = LLM(model, cuda_graphs=True, prefill_graph_max_tokens=0, **kw)
    want = [plain.generate([p], max_new_tokens=8, ignore_eos=True)[0] for p in prompts[:len(LENGTHS)]]
    plain.generate([base], max_new_tokens=2, ignore_eos=True)
    want += [plain.generate([p], max_new_tokens=8, ignore_eos=True)[0] for p in prompts[len(LENGTHS):]]
    outs, want = outs + outs_together, want + plain.generate(together, max_new_tokens=8, ignore_eos=True)
    prompts = prompts + together
    same = sum(a == b for a, b in zip(outs, want))
    print(f"PREFILL GRAPHS {arch} k={k}: {graphs.replays} replays, lengths {served}; "
          f"{same}/{len(prompts)} outputs equal to the eager prefill's")
