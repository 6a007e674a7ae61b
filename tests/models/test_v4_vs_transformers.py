"""models.v4 on the reference backend vs transformers' own ``deepseek_v4``, on tiny random
checkpoints that transformers built and saved (tests/models/hf_v4_tiny.py)."""

from __future__ import annotations

import pytest
import torch

from models.registry import arch_spec, load_any_config, load_any_model
from tests.models.hf_v4_tiny import CONFIGS, save_hf_v4
from tests.workers.hf_tiny import use_tie_rule
from tests.workers.prompts import random_prompt


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp(request.param)
    save_hf_v4(request.param, path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    use_tie_rule(hf)  # exact index-score ties: transformers' topk picks arbitrarily, we pick the lower entry
    ours = load_any_model(path, dtype=torch.float32)
    return request.param, hf, ours


def _prompt_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(model(torch.tensor(ids), [len(ids)], [model.new_state()]))


def _greedy(model, prompt: list[int], new: int) -> list[int]:
    """Prefill, then one token per forward through the sequence state."""
    st = model.new_state()
    out: list[int] = []
    with torch.no_grad():
        h = model(torch.tensor(prompt), [len(prompt)], [st])[-1:]
        for _ in range(new):
            out.append(int(model.logits(h).argmax(-1)))
            h = model(torch.tensor(out[-1:]), [1], [st])
    return out


def test_prompt_logits_match(pair):
    name, hf, ours = pair
    cfg = ours.cfg
    ids = random_prompt(40, cfg.vocab_size, 40)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    got = _prompt_logits(ours, ids)
    assert got.shape == ref.shape
    # float32 rounding of different summation orders.
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # The prompt crosses several windows and compressed blocks of every compressing layer.
    assert len(ids) > 3 * cfg.sliding_window
    for layer in range(cfg.num_hidden_layers):
        ratio = cfg.compress_ratio(layer)
        assert ratio == 0 or len(ids) // ratio >= 3
        if cfg.has_indexer(layer):
            assert len(ids) // ratio > cfg.index_topk  # the indexer really selects


def test_greedy_matches(pair):
    name, hf, ours = pair
    new = 10
    for n in (3, 23):
        p = random_prompt(n, hf.config.vocab_size, 100 + n)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, n:].tolist()
        assert _greedy(ours, p, new) == ref, f"{name}: prompt of {n} tokens diverged"


def test_chunked_and_batched_prefill_equal_one_shot(pair):
    """The sequence state carries windows, partial compressed blocks and the CSA
    overlap across forwards: any chunking, and batching with another sequence,
    gives the one-shot logits."""
    name, hf, ours = pair
    ids = random_prompt(37, ours.cfg.vocab_size, 7)
    whole = _prompt_logits(ours, ids)
    st = ours.new_state()
    parts = []
    with torch.no_grad():
        for s0, s1 in ((0, 5), (5, 6), (6, 19), (19, 37)):
            parts.append(ours.logits(ours(torch.tensor(ids[s0:s1]), [s1 - s0], [st])))
        other = random_prompt(11, ours.cfg.vocab_size, 8)
        both = ours.logits(ours(torch.tensor(other + ids), [11, 37], [ours.new_state(), ours.new_state()]))
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both[11:], whole, rtol=1e-5, atol=1e-5)
    assert st.seq_len == 37


def test_compression_and_selection_change_the_result(pair):
    """Lifting the indexer's top-k (CSA) changes the logits, so the match above
    depends on selecting what transformers selects."""
    name, hf, ours = pair
    ids = random_prompt(40, ours.cfg.vocab_size, 40)
    base = _prompt_logits(ours, ids)
    indexers = [layer.attn.indexer for layer in ours.layers if layer.attn.indexer is not None]
    assert indexers
    saved = [ix.topk for ix in indexers]
    try:
        for ix in indexers:
            ix.topk = 10**6
        dense = _prompt_logits(ours, ids)
    finally:
        for ix, k in zip(indexers, saved):
            ix.topk = k
    assert (dense - base).abs().max() > 1e-3


def test_registry_parses_and_counts(pair, tmp_path):
    name, hf, ours = pair
    cfg = ours.cfg
    assert arch_spec("deepseek_v4").parse_config is not None
    assert cfg == load_any_config(hf.name_or_path)
    ours_n = sum(p.numel() for p in ours.parameters())
    # transformers holds the same weights (hash tables and routing biases as buffers, ours are parameters).
    hf_n = sum(p.numel() for p in hf.parameters()) + sum(
        b.numel() for n, b in hf.named_buffers() if n.endswith(("tid2eid", "e_score_correction_bias")))
    assert ours_n == hf_n
