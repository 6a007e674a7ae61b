"""32k- and 128k-token prompts through chunked prefill on the cuda backend (issue 3).

The model: DeepSeek-V3.2's attention at its real dims (128 query heads, 512 +
64 latent, 64 x 128 indexer, top-k 2048, YaRN to 160k positions) in two dense
layers with a small hidden size, random weights, bf16, fp8 caches.

* 32k: the whole prompt is prefilled in 8k-token chunks on the cuda backend
  and in 512-token chunks on the reference backend (same GPU); logits at
  sampled positions (the last included) agree within the tolerances of the
  end-to-end cuda-vs-reference test.
* 128k: the cuda backend prefills all but the last 256 tokens in 8k chunks;
  the reference backend is handed a byte copy of that fp8 cache (same format,
  same page ids) and both run the last chunk over the 128k-token cached
  prefix: their logits agree on every row of it.
* The naive path -- the whole 128k prompt as one forward -- is tried and its
  outcome printed (it needs the [S, h, 576] f32 queries and [S, h, 512]
  outputs of all 128k rows at once).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

DSV32_ATTENTION = dict(
    num_hidden_layers=2, first_k_dense_replace=2, hidden_size=1024, intermediate_size=2048,
    num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, index_n_heads=64, index_head_dim=128,
    index_topk=2048, max_position_embeddings=163840, num_nextn_predict_layers=0,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1.0, "mscale_all_dim": 1.0},
)
MAX_REL_TOL, MEDIAN_REL_TOL = 0.3, 0.1  # as tests/attention/test_cuda_backend.py's E2E test


def chunk_logits(llm, prompt, pages, start, end, chunk, rows):
    """Prefill ``prompt[start:end]`` in ``chunk``-token EXTEND forwards into
    ``pages``; f32 logits ``[len(rows), vocab]`` at absolute positions ``rows``."""
    from models.batch import ForwardMode
    from workers.model_runner import WorkItem

    out = {}
    with torch.inference_mode():
        for s in range(start, end, chunk):
            e = min(s + chunk, end)
            _, h = llm.runner.forward(ForwardMode.EXTEND, [WorkItem(tuple(prompt[s:e]), s, tuple(pages))])
            want = [r for r in rows if s <= r < e]
            if want:
                logits = llm.model.logits(h[torch.tensor([r - s for r in want], device=h.device)]).float().cpu()
                out.update(zip(want, logits))
    return torch.stack([out[r] for r in rows]) if rows else None


def rel_errors(a, b):
    return [float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b)]


def test_long_prompt_chunked_prefill_gpu(tmp_path):
    from models.batch import ForwardMode
    from models.tiny import make_tiny
    from workers.model_runner import WorkItem
    from workers.offline import LLM

    model = make_tiny("deepseek_v32", tmp_path / "m", seed=5, **DSV32_ATTENTION)
    n32, n128, tail = 32768, 131072, 256
    kw = dict(device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", num_pages=n128 // 64 + 8, cuda_graphs=False)
    cuda, ref = LLM(model, backend="cuda", **kw), LLM(model, backend="reference", **kw)
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(2, 300, (n128,), generator=g).tolist()

    # 32k end to end, both backends chunked.
    rows = [0, 1000, 8191, 8192, 20000, 30001, n32 - 1]
    pc, pr = cuda.pool.allocate_for_tokens(n32), ref.pool.allocate_for_tokens(n32)
    torch.cuda.reset_peak_memory_stats()
    lc = chunk_logits(cuda, prompt, pc, 0, n32, 8192, rows)
    peak32 = torch.cuda.max_memory_allocated() / 2**30
    lr = chunk_logits(ref, prompt, pr, 0, n32, 512, rows)
    cuda.pool.free(pc), ref.pool.free(pr)
    err32 = rel_errors(lc, lr)
    agree32 = float((lc.argmax(-1) == lr.argmax(-1)).float().mean())

    # 128k: cuda prefills the prefix; both run the last chunk over it.
    pc, pr = cuda.pool.allocate_for_tokens(n128), ref.pool.allocate_for_tokens(n128)
    assert pc == pr  # fresh pools hand out the same ids: the cache copy lines up
    torch.cuda.reset_peak_memory_stats()
    chunk_logits(cuda, prompt, pc, 0, n128 - tail, 8192, [])
    peak128 = torch.cuda.max_memory_allocated() / 2**30
    with torch.no_grad():
        for dst, src in zip(ref.cache.mla, cuda.cache.mla):
            dst.copy_(src)
        for dst, src in zip(ref.cache.index, cuda.cache.index):
            if src is not None:
                dst.copy_(src)
    last = list(range(n128 - tail, n128))
    lc = chunk_logits(cuda, prompt, pc, n128 - tail, n128, tail, last)
    lr = chunk_logits(ref, prompt, pr, n128 - tail, n128, tail, last)
    err128 = rel_errors(lc, lr)
    agree128 = float((lc.argmax(-1) == lr.argmax(-1)).float().mean())

    # The naive path: all 128k rows in one forward.
    del ref
    torch.cuda.empty_cache()
    try:
        with torch.inference_mode():
            cuda.runner.forward(ForwardMode.EXTEND, [WorkItem(tuple(prompt), 0, tuple(pc))])
        naive = f"fit (peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB)"
    except torch.OutOfMemoryError as e:
        naive = "out of memory: " + str(e).split("\n")[0][:160]
    torch.cuda.empty_cache()
    cuda.pool.free(pc)

    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(f"LONG 32k: chunked cuda (8k chunks) vs reference (512 chunks) at rows {rows}: "
          f"max_rel_err={max(err32):.3e} median={med(err32):.3e} argmax_agreement={agree32:.2f} "
          f"peak={peak32:.1f} GiB")
    print(f"LONG 128k: last {tail} rows over the cached 128k prefix, cuda vs reference on the same bytes: "
          f"max_rel_err={max(err128):.3e} median={med(err128):.3e} argmax_agreement={agree128:.2f}; "
          f"cuda 128k prefix prefill peak={peak128:.1f} GiB; naive one-forward 128k: {naive}")
    assert max(err32) <= MAX_REL_TOL and med(err32) <= MEDIAN_REL_TOL
    assert max(err128) <= MAX_REL_TOL and med(err128) <= MEDIAN_REL_TOL
