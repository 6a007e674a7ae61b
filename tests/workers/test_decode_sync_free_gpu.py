"""The overlapped decode loop never makes the host wait for the device except at its one read-back.

Issue 19's "the host is off the critical path" needs every host-to-device copy of a step's inputs
to be non-blocking (`workers.host_copy`): a blocking copy synchronizes the stream, so the host
waits for the step in flight and the device then idles while the host launches the next one (H100,
session 18: 1.30x wall over GPU busy at batch 1 from one such copy). PyTorch's sync debug mode
raises on every synchronizing call (blocking copies, ``.item()``, ``.tolist()`` of a device tensor,
stream / device synchronizes); the read-back waits on a CUDA event, which it does not count.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

SERVING_DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128, index_n_heads=64,
                    num_attention_heads=16, index_topk=64)
KW = dict(backend="cuda", device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", num_pages=128, chunk_size=64)


@pytest.mark.parametrize("sampling", [
    dict(temperature=0.0),
    dict(temperature=0.8, top_p=0.9, top_k=20, seed=3),
    dict(temperature=1.0, min_p=0.05, seed=4, logit_bias=((7, 2.0),)),
], ids=["greedy", "top-p-top-k", "min-p-bias"])
def test_steady_decode_steps_do_not_synchronize_gpu(tmp_path, sampling):
    from models.tiny import make_tiny
    from workers.offline import LLM
    from workers.request import Request
    from workers.sample.params import SamplingParams

    model = make_tiny("deepseek_v32", tmp_path / "m", seed=5, **SERVING_DIMS)
    llm = LLM(model, **KW)
    eng = llm.engine
    assert eng.runner.decode_graphs, "the cuda engine runs its decode steps through CUDA graphs"
    params = {k: v for k, v in sampling.items() if k != "seed"}
    reqs = [Request(f"r{i}", [40 + (i * 7 + j) % 80 for j in range(9 + 5 * i)],
                    SamplingParams(40, ignore_eos=True, seed=sampling.get("seed"), **params)) for i in range(6)]
    for r in reqs:
        assert eng.add_request(r) is None
    # Prefill and the first decode steps may synchronize (prompt admission reads back).
    while any(len(r.output) < 4 for r in reqs):
        eng.step()
    assert eng._can_overlap(), "a pure-decode batch of unconstrained requests overlaps its steps"
    steps = 0
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        while all(len(r.output) < 30 for r in reqs):
            eng.step()
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert steps >= 20
    while eng.has_work:
        eng.step()
    assert all(len(r.output) == 40 for r in reqs)
    assert eng.pool.free_count == eng.pool.num_pages
