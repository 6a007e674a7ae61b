"""Batch invariance of the sparse selection at the model level (issue 19, item 4).

A tiny model whose indexer queries are zeroed scores every visible token 0
(every head's ReLU is zero): the whole context is one exact tie. The tie rule
(lower position first) then selects the first ``index_topk`` positions, and a
prompt decodes the same alone as batched with a longer prompt, whose longer
context widens the decode indexer's logits rows. ``torch.topk`` alone broke
those ties differently at different row widths and changed the output.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attention.backend import get_backend
from attention.cache import CacheSpec, PagedKVCache
from models.batch import ForwardBatch, ForwardMode, slots_for_positions
from models.indexer import Indexer
from models.loader import load_model
from models.tiny import make_tiny

TOPK = 16
SHORT, LONG = 40, 120  # decode logits rows ~41 wide alone, ~121 batched
STEPS = 4
TABLES = {"short": [0], "long": [1, 2]}  # pages of each request (same alone and batched)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny("deepseek_v32", tmp_path_factory.mktemp("ties") / "v32", seed=1, index_topk=TOPK,
                     num_nextn_predict_layers=0)


def _load(tiny_dir, zero_queries: bool):
    model = load_model(tiny_dir, dtype=torch.float32, with_mtp=False)
    indexers = [m for m in model.modules() if isinstance(m, Indexer)]
    assert indexers
    if zero_queries:
        with torch.no_grad():
            for m in indexers:
                m.wq_b.weight.zero_()  # q = 0: every index score is exactly (+/-) 0
    return model


def _recording_backend(log: list):
    ref = get_backend("reference")

    def topk_slots(logits, lengths, topk, page_table_rows):
        positions, slots = ref.topk_slots(logits, lengths, topk, page_table_rows)
        log.append(positions.clone())
        return positions, slots

    return dataclasses.replace(ref, topk_slots=topk_slots)


def _batch(mode, reqs):
    """reqs: [(name, new token ids, start position)] -> ForwardBatch."""
    width = max(len(TABLES[name]) for name, _, _ in reqs)
    ids, pos, slots, tables, seq, q = [], [], [], [], [], []
    for name, toks, start in reqs:
        table = torch.tensor(TABLES[name] + [0] * (width - len(TABLES[name])), dtype=torch.int32)
        p = torch.arange(start, start + len(toks))
        ids.append(torch.tensor(toks))
        pos.append(p)
        slots.append(slots_for_positions(table, p))
        tables.append(table)
        seq.append(start + len(toks))
        q.append(len(toks))
    return ForwardBatch(mode, torch.cat(ids), torch.cat(pos), torch.cat(slots), torch.stack(tables),
                        torch.tensor(seq), torch.tensor(q), max_seq_len=max(seq))


@torch.inference_mode()
def _greedy(model, prompts: dict, decode_names: list[str]):
    """Prefill every prompt (one forward each), then STEPS decode steps over
    ``decode_names`` together. Returns ({name: tokens}, {name: [decode logits]},
    {name: [decode positions selected by the first layer's indexer]})."""
    spec = CacheSpec(num_layers=model.num_cache_layers, num_pages=8, kv_lora_rank=model.cfg.kv_lora_rank,
                     rope_dim=model.cfg.qk_rope_head_dim, index_head_dim=model.cfg.index_head_dim,
                     kv_cache_dtype="auto", dtype=torch.float32,
                     indexer_layers=tuple(model.cfg.topk_plan.computes))
    cache = PagedKVCache(spec, "cpu")
    log: list = []
    backend = _recording_backend(log)
    seqs = {}
    for name in decode_names:
        b = _batch(ForwardMode.PREFILL, [(name, prompts[name], 0)])
        hidden = model(b, cache, backend)
        seqs[name] = list(prompts[name]) + [int(model.logits(hidden[-1:]).argmax())]
    logits = {n: [] for n in decode_names}
    picked = {n: [] for n in decode_names}
    for _ in range(STEPS):
        b = _batch(ForwardMode.DECODE, [(n, seqs[n][-1:], len(seqs[n]) - 1) for n in decode_names])
        log.clear()
        out = model.logits(model(b, cache, backend))
        for i, n in enumerate(decode_names):
            logits[n].append(out[i])
            picked[n].append(log[0][i])
            seqs[n].append(int(out[i].argmax()))
    tokens = {n: seqs[n][len(prompts[n]):] for n in decode_names}
    return tokens, logits, picked


def _prompts(vocab):
    gen = torch.Generator().manual_seed(5)
    return {"short": torch.randint(3, vocab, (SHORT,), generator=gen).tolist(),
            "long": torch.randint(3, vocab, (LONG,), generator=gen).tolist()}


def test_tied_scores_select_first_positions_alone_and_batched(tiny_dir):
    model = _load(tiny_dir, zero_queries=True)
    prompts = _prompts(model.cfg.vocab_size)
    alone_tok, alone_logits, alone_pick = _greedy(model, prompts, ["short"])
    both_tok, both_logits, both_pick = _greedy(model, prompts, ["short", "long"])

    # Batch invariance: the short prompt's selection (same positions, same
    # order), logits and greedy tokens do not depend on the long prompt.
    for step in range(STEPS):
        assert torch.equal(both_pick["short"][step], alone_pick["short"][step]), f"step {step}: selection"
    for a, b in zip(alone_logits["short"], both_logits["short"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert both_tok["short"] == alone_tok["short"]
    # The rule: every score ties, so the lowest positions are selected, in order.
    first = list(range(TOPK))
    for step in range(STEPS):
        assert alone_pick["short"][step].tolist() == first, f"step {step}: alone"
        assert both_pick["long"][step].tolist() == first, f"step {step}: the long prompt"


def test_selection_bit_identical_alone_and_batched(tiny_dir):
    """The same model with its real indexer: the index scores of a request do not
    depend on the longer batch-mate (bit for bit), so neither does its selection."""
    model = _load(tiny_dir, zero_queries=False)
    prompts = _prompts(model.cfg.vocab_size)
    alone_tok, _, alone_pick = _greedy(model, prompts, ["short"])
    both_tok, _, both_pick = _greedy(model, prompts, ["short", "long"])
    for step in range(STEPS):
        assert torch.equal(both_pick["short"][step], alone_pick["short"][step]), f"step {step}"
    assert alone_pick["short"][0].tolist() != list(range(TOPK))  # a real selection, not the tie rule's
    assert both_tok["short"] == alone_tok["short"]
