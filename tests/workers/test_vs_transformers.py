"""Our model on the reference backend vs transformers' own implementation."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.workers.hf_tiny import CONFIGS, save_hf_model, use_tie_rule
from workers.offline import LLM
from tests.workers.prompts import random_prompt


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_hf_model(request.param, path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    use_tie_rule(hf)  # exact index-score ties: transformers' torch.topk picks arbitrarily, we pick the lower position
    ours = LLM(path, dtype="float32", kv_cache_dtype="auto")
    return request.param, hf, ours




@pytest.mark.parametrize("length", [5, 40, 130])
def test_prompt_logits_match(pair, length):
    name, hf, ours = pair
    ids = random_prompt(length, hf.config.vocab_size, length)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    got = ours.prompt_logits(ids)
    assert got.shape == ref.shape
    # float32 rounding of two different summation orders (absorbed vs expanded MLA).
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # The indexer really selects: the prompt is longer than index_topk.
    assert length < 12 or length > ours.cfg.index_topk


def test_greedy_generate_matches(pair):
    name, hf, ours = pair
    prompts = [random_prompt(n, hf.config.vocab_size, 100 + n) for n in (3, 17, 64, 70)]
    new = 24
    got = ours.generate(prompts, max_new_tokens=new, ignore_eos=True)
    for p, g in zip(prompts, got):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert g == ref, f"{name}: prompt of {len(p)} tokens diverged"


def test_sparsity_really_selects(pair):
    """Dense attention (indexer top-k lifted) gives different logits, so the
    match above depends on selecting the same tokens transformers selects."""
    name, hf, ours = pair
    ids = random_prompt(130, hf.config.vocab_size, 130)
    indexers = [l.self_attn.indexer for l in hf.model.layers if getattr(l.self_attn, "indexer", None) is not None]
    saved = [ix.index_topk for ix in indexers]
    try:
        for ix in indexers:
            ix.index_topk = 10**6
        with torch.no_grad():
            dense = hf(torch.tensor([ids])).logits[0].float()
    finally:
        for ix, k in zip(indexers, saved):
            ix.index_topk = k
    got = ours.prompt_logits(ids)
    assert (got - dense).abs().max() > 1e-2
