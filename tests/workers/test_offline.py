"""The offline LLM: fp8 checkpoints, fp8 caches, paged decode, batching, MTP layer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from models.tiny import make_tiny
from models.weights import load_checkpoint, write_fp8_checkpoint
from models.batch import ForwardMode
from tests.workers.hf_tiny import save_hf_model
from workers.model_runner import WorkItem
from workers.offline import LLM
from tests.workers.prompts import random_prompt




@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def tiny(request, tmp_path_factory):
    return make_tiny(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"), seed=3)


def test_fp8_block_quantized_checkpoint_matches_transformers(tmp_path):
    """fp8 weights (128x128 block scales) load dequantized and equal transformers
    run on the same dequantized weights."""
    src, fp8, deq = tmp_path / "src", tmp_path / "fp8", tmp_path / "deq"
    save_hf_model("v32_sparse", src)
    write_fp8_checkpoint(src, fp8, block=(128, 128))
    assert json.loads((fp8 / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    # The same weights, dequantized, in a plain checkpoint transformers can read.
    deq.mkdir()
    tensors = {k: v.contiguous() for k, v in load_checkpoint(fp8, dtype=torch.float32).items()}
    save_file(tensors, str(deq / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg.pop("quantization_config")
    (deq / "config.json").write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32, attn_implementation="eager").eval()
    hf_orig = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()

    ours = LLM(fp8, dtype="float32", kv_cache_dtype="auto")
    ids = random_prompt(90, hf.config.vocab_size, 1)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        orig = hf_orig(torch.tensor([ids])).logits[0]
    got = ours.prompt_logits(ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # Quantization really happened: the original weights give other logits.
    assert (got - orig).abs().max() > 1e-3
    out = ours.generate([ids[:20]], max_new_tokens=12, ignore_eos=True)[0]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids[:20]]), max_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, 20:].tolist()
    assert out == want


def _rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(relative L2 error, top-1 agreement) of logits ``b`` against ``a``."""
    return ((a - b).norm() / a.norm()).item(), (a.argmax(-1) == b.argmax(-1)).float().mean().item()


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_fp8_cache_close_to_bf16(arch, tmp_path, capsys):
    """Serving byte formats (fp8 latent + fp8 indexer keys + Hadamard) vs bf16 caches,
    both measured against the fp32 exact model.

    With dense selection (index_topk > prompt) the error is the formats' own.
    With sparse selection a tiny model's top-k flips amplify every rounding
    difference (bf16 alone flips some), so there we only report the numbers.
    """
    report = []
    for topk in (4096, 16):
        path = make_tiny(arch, tmp_path / f"k{topk}", seed=3, index_topk=topk)
        ids = random_prompt(150, 300, 7)
        exact = LLM(path, dtype="float32").prompt_logits(ids)
        err_bf16 = _rel(exact, LLM(path, dtype="bfloat16", kv_cache_dtype="auto").prompt_logits(ids))
        err_fp8 = _rel(exact, LLM(path, dtype="bfloat16", kv_cache_dtype="fp8").prompt_logits(ids))
        report.append(f"topk={topk}: bf16-cache err {err_bf16[0]:.3f} (top-1 {err_bf16[1]:.2f}), "
                      f"fp8-cache err {err_fp8[0]:.3f} (top-1 {err_fp8[1]:.2f})")
        if topk == 4096:
            assert err_fp8[0] < 3 * err_bf16[0] + 0.05
            assert err_fp8[1] > 0.85
    with capsys.disabled():
        print(f"\n[{arch}] logits vs fp32 exact: " + "; ".join(report))


@torch.inference_mode()
def last_token_logits(model, batch, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 ``[R, vocab]`` logits of each request's last new token."""
    return model.logits(hidden[torch.cumsum(batch.q_lens, 0) - 1])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_incremental_paged_decode_equals_full_recompute(tiny, kv_cache_dtype):
    llm = LLM(tiny, dtype="float32", kv_cache_dtype=kv_cache_dtype)
    prompt = random_prompt(61, llm.cfg.vocab_size, 11)  # decode crosses a page boundary
    steps = 9
    pages = tuple(llm.pool.allocate(2))
    try:
        batch, hidden = llm.runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(prompt), 0, pages)])
        logits = [last_token_logits(llm.model, batch, hidden)[0]]
        seq = list(prompt)
        for _ in range(steps):
            seq.append(int(logits[-1].argmax()))
            batch, hidden = llm.runner.forward(ForwardMode.DECODE, [WorkItem((seq[-1],), len(seq) - 1, pages)])
            logits.append(last_token_logits(llm.model, batch, hidden)[0])
    finally:
        llm.pool.free(list(pages))
    full = llm.prompt_logits(seq)
    got = torch.stack(logits)
    want = full[len(prompt) - 1:]
    tol = 1e-4 if kv_cache_dtype == "auto" else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert llm.pool.free_count == llm.pool.num_pages


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_batched_equals_alone(tiny, kv_cache_dtype):
    llm = LLM(tiny, dtype="float32", kv_cache_dtype=kv_cache_dtype)
    prompts = [random_prompt(n, llm.cfg.vocab_size, n) for n in (1, 64, 65, 30, 128)]
    together = llm.generate(prompts, max_new_tokens=10, ignore_eos=True)
    alone = [llm.generate([p], max_new_tokens=10, ignore_eos=True)[0] for p in prompts]
    assert together == alone
    assert llm.pool.free_count == llm.pool.num_pages


def test_stop_tokens_and_sampling(tiny):
    llm = LLM(tiny, dtype="float32")
    p = random_prompt(20, llm.cfg.vocab_size, 5)
    greedy = llm.generate([p], max_new_tokens=8, ignore_eos=True)[0]
    stopped = llm.generate([p], max_new_tokens=8, stop_token_ids=(greedy[3],), ignore_eos=True)[0]
    assert stopped == greedy[: greedy.index(greedy[3]) + 1]
    s1 = llm.generate([p, p], max_new_tokens=8, temperature=1.0, seed=123)
    s2 = llm.generate([p, p], max_new_tokens=8, temperature=1.0, seed=123)
    assert s1 == s2


def test_mtp_layer_loaded_and_runnable(tiny):
    llm = LLM(tiny, dtype="float32")
    assert llm.cfg.num_nextn_predict_layers == 1 and len(llm.model.mtp) == 1
    ids = random_prompt(40, llm.cfg.vocab_size, 2)
    pages = tuple(llm.pool.allocate(1))
    try:
        batch, hidden = llm.runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(ids), 0, pages)])
        # MTP input at position i: token i + 1 with the target hidden at i.
        shifted = llm.runner.build_batch(ForwardMode.PREFILL, [WorkItem(tuple(ids[1:]) + (0,), 0, pages)])
        with torch.inference_mode():
            before = llm.cache.storage.clone()
            # A prompt's prefill wants only the MTP layer's cache pages: no head.
            none, cache_hidden, _ = llm.model.mtp_forward(shifted, hidden, llm.cache, llm.runner.backend,
                                                          draft=False)
            written = llm.cache.storage.clone()
            draft, draft_hidden, _ = llm.model.mtp_forward(shifted, hidden, llm.cache, llm.runner.backend)
    finally:
        llm.pool.free(list(pages))
    assert none is None and torch.equal(cache_hidden, draft_hidden)
    # The cache-only pass wrote the MTP layer's pages, the very bytes the drafting pass writes.
    assert not torch.equal(written, before) and torch.equal(llm.cache.storage, written)
    assert draft.shape == (40, llm.cfg.vocab_size) and torch.isfinite(draft).all()
    main = llm.model.logits(hidden)
    assert not torch.allclose(draft, main)


def test_missing_mtp_weights_is_an_error(tmp_path, tiny):
    """A config that declares an MTP layer whose weights are absent fails loudly."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    mtp_file = {f for k, f in index["weight_map"].items() if k.startswith(f"model.layers.{4}.")}
    for f in mtp_file:
        (broken / f).unlink()
    index["weight_map"] = {k: f for k, f in index["weight_map"].items() if f not in mtp_file}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="mtp"):
        LLM(broken)
