"""Packed prefill contexts (``models.batch.PackedContext``): one cache gather, one indexer call and one
sparse-attention call per layer for every request of a PREFILL forward.

* the packed slots and windows equal the per-request construction (``ForwardBatch.context_slots``), on
  random page tables, cached prefixes and chunk lengths; with and without the builder's host lengths;
  in one group and split into groups of at most ``PACK_MAX_POSITIONS`` positions;
* a request's prefill gives the same hidden states and the same top-k selection whether it runs alone or
  packed with others (one with a cached prefix, one from scratch), on the reference backend, in one
  group or two.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from attention.backend import get_backend
from attention.cache import CacheSpec, PagedKVCache
from attention.formats import PAGE_SIZE
from models.batch import ForwardBatch, ForwardMode, PackedContext, slots_for_positions
from models.loader import load_model
from models.tiny import make_tiny

SEED = random.randrange(1 << 30)


def _batch(reqs, host: bool = True) -> ForwardBatch:
    """reqs: [(page table, start position, new token count)] -> a PREFILL batch (token ids 3..)."""
    width = max(len(t) for t, _, _ in reqs)
    pos, slots, tables = [], [], []
    for table, start, n in reqs:
        t = torch.tensor(table + [0] * (width - len(table)), dtype=torch.int32)
        p = torch.arange(start, start + n)
        pos.append(p)
        slots.append(slots_for_positions(t, p))
        tables.append(t)
    seq = [s + n for _, s, n in reqs]
    q = [n for _, _, n in reqs]
    T = sum(q)
    return ForwardBatch(ForwardMode.PREFILL, torch.arange(3, 3 + T) % 50 + 3, torch.cat(pos), torch.cat(slots),
                        torch.stack(tables), torch.tensor(seq), torch.tensor(q), max_seq_len=max(seq),
                        seq_lens_host=tuple(seq) if host else None, q_lens_host=tuple(q) if host else None)


def _random_reqs(rng: random.Random, free_pages: list[int]):
    reqs = []
    for _ in range(rng.randint(1, 5)):
        start = rng.choice([0, 0, rng.randint(1, 200)])  # a cached prefix (or an earlier chunk) or none
        n = rng.randint(1, 150)
        table = [free_pages.pop() for _ in range(-(-(start + n) // PAGE_SIZE))]
        reqs.append((table, start, n))
    return reqs


@pytest.mark.parametrize("host", [True, False])
@pytest.mark.parametrize("limit", [1 << 17, 150])
def test_packed_context_equals_per_request(host, limit, monkeypatch):
    import models.batch

    monkeypatch.setattr(models.batch, "PACK_MAX_POSITIONS", limit)
    rng = random.Random(SEED)
    for trial in range(20):
        pages = list(range(400))
        rng.shuffle(pages)
        batch = _batch(_random_reqs(rng, pages), host)
        groups = batch.packed_contexts()
        assert batch.packed_contexts() is groups  # built once per forward
        ranges = batch.query_ranges()
        seq = batch.seq_lens.tolist()
        assert groups[0].tokens.start == 0 and groups[-1].tokens.stop == batch.num_tokens
        for a, b in zip(groups, groups[1:]):
            assert a.tokens.stop == b.tokens.start
        for ctx in groups:
            reqs = [r for r, (s0, s1) in enumerate(ranges) if ctx.tokens.start <= s0 and s1 <= ctx.tokens.stop]
            assert sum(ranges[r][1] - ranges[r][0] for r in reqs) == ctx.tokens.stop - ctx.tokens.start
            assert len(reqs) == 1 or sum(seq[r] for r in reqs) <= limit, (SEED, trial)
            want = torch.cat([batch.context_slots(r) for r in reqs])
            assert torch.equal(ctx.slots, want), (SEED, trial)
            starts = np.cumsum([0] + [seq[r] for r in reqs][:-1])
            for i, r in enumerate(reqs):
                s0, s1 = (x - ctx.tokens.start for x in ranges[r])
                assert (ctx.row_start[s0:s1] == int(starts[i])).all()
                got_end = ctx.row_end[s0:s1].long()
                assert torch.equal(got_end, int(starts[i]) + batch.positions[ranges[r][0]:ranges[r][1]] + 1)
            assert np.array_equal(ctx.row_start_host, ctx.row_start.numpy())
            assert np.array_equal(ctx.row_end_host, ctx.row_end.numpy())
            # request-local positions -> packed indices -> (slots, positions): the same positions, their slots
            t = ctx.tokens.stop - ctx.tokens.start
            local = torch.randint(-1, 1 << 20, (t, 7)) % (ctx.row_end - ctx.row_start).long()[:, None]
            local[:, 0] = -1
            slots, back = ctx.local(ctx.packed_indices(local))
            assert torch.equal(back, local)
            for i in range(t):
                r = next(r for r in reqs if ranges[r][0] <= ctx.tokens.start + i < ranges[r][1])
                for j in range(1, 7):
                    assert int(slots[i, j]) == int(batch.context_slots(r)[local[i, j]])
            assert (slots[:, 0] == -1).all()


def test_host_lens_match_the_device():
    batch = _batch([([3, 4], 10, 70), ([9], 0, 5)])
    assert batch.host_lens() == ((80, 5), (70, 5))
    bare = _batch([([3, 4], 10, 70), ([9], 0, 5)], host=False)
    assert bare.host_lens() == batch.host_lens()
    assert bare.query_ranges() == [(0, 70), (70, 75)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = make_tiny("deepseek_v32", tmp_path_factory.mktemp("packed") / "v32", seed=3, index_topk=16,
                  num_nextn_predict_layers=0)
    return load_model(d, dtype=torch.float32, with_mtp=False)


def _recording(log: list):
    ref = get_backend("reference")

    def sparse_mla_prefill(q, kv, indices, scale, d_v=None):
        log.append(indices.clone())
        return ref.sparse_mla_prefill(q, kv, indices, scale, d_v)

    return dataclasses.replace(ref, sparse_mla_prefill=sparse_mla_prefill)


@pytest.mark.parametrize("limit", [1 << 17, 100])  # one group; A alone, then B and C (55 positions)
@torch.inference_mode()
def test_prefill_packed_equals_alone(tiny, limit, monkeypatch):
    """A: 70 new tokens over a cached 60-token prefix (written by an earlier forward), B: 45 from
    scratch, C: 1 token. Packed in one forward, each request's hidden states and selected positions
    equal its forward alone (the packed kernel sees other requests' keys but never selects them)."""
    import models.batch

    monkeypatch.setattr(models.batch, "PACK_MAX_POSITIONS", limit)
    cfg = tiny.cfg
    cache = _cache(tiny)
    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(3, cfg.vocab_size, (300,), generator=gen)
    reqs = {"A": ([0, 1, 2], 60, 70), "B": ([5], 0, 45), "C": ([7], 0, 1)}
    tiny(_with_tokens(_batch([([0, 1, 2], 0, 60)]), tokens[:60]), cache, get_backend("reference"))  # A's prefix

    def run(names):
        log: list = []
        b = _with_tokens(_batch([reqs[n] for n in names]), torch.cat([_tokens_of(n, tokens) for n in names]))
        hidden = tiny(b, cache, _recording(log))
        groups = b.packed_contexts()
        # request-local positions per layer: one logged call per group, in order
        picks = [torch.cat([ctx.local(idx[:, 0])[1] for ctx, idx in zip(groups, log[i:i + len(groups)])])
                 for i in range(0, len(log), len(groups))]
        if names == ["A", "B", "C"]:
            assert len(groups) == (1 if limit > 1000 else 2)
        return hidden, picks, b.query_ranges()

    alone = {n: run([n]) for n in reqs}
    hidden, picks, ranges = run(["A", "B", "C"])
    for n, (s0, s1) in zip(["A", "B", "C"], ranges):
        h, p, _ = alone[n]
        torch.testing.assert_close(hidden[s0:s1], h, rtol=1e-5, atol=1e-5)
        for layer, (got, want) in enumerate(zip(picks, p)):
            # The kernel gets columns up to its group's widest window (past it a row holds only -1).
            w = max(got.shape[1], want.shape[1])
            assert torch.equal(_pad_cols(got[s0:s1], w), _pad_cols(want, w)), (n, layer, SEED)
    assert any((p[:, 1:] >= 0).any() for p in picks)  # real selections (more than one position)


def _cache(tiny) -> PagedKVCache:
    """16 pages of unquantized fp32 cache for the tiny model's layers (CPU)."""
    cfg = tiny.cfg
    spec = CacheSpec(num_layers=tiny.num_cache_layers, num_pages=16, kv_lora_rank=cfg.kv_lora_rank,
                     rope_dim=cfg.qk_rope_head_dim, index_head_dim=cfg.index_head_dim, kv_cache_dtype="auto",
                     dtype=torch.float32, indexer_layers=tuple(cfg.topk_plan.computes))
    return PagedKVCache(spec, "cpu")


def _pad_cols(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=-1)


def _tokens_of(name: str, tokens: torch.Tensor) -> torch.Tensor:
    return {"A": tokens[60:130], "B": tokens[130:175], "C": tokens[175:176]}[name]


def _with_tokens(batch: ForwardBatch, ids: torch.Tensor) -> ForwardBatch:
    return dataclasses.replace(batch, input_ids=ids)


@torch.inference_mode()
def test_whole_window_selection_equals_scored(tiny, monkeypatch):
    """When every new token's causal window holds at most ``index_topk`` keys, the indexer selects the
    whole windows without scoring them, and attention reads only the group's widest window: the hidden
    states and each token's selected set equal the scored path's (forced here by pretending the windows
    are wider than top-k), over a cached prefix, from scratch and for a lone token."""
    cfg = tiny.cfg
    k = cfg.index_topk
    cache = _cache(tiny)
    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(3, cfg.vocab_size, (64,), generator=gen)
    prefix = k // 2 - 1
    tiny(_with_tokens(_batch([([0], 0, prefix)]), tokens[:prefix]), cache, get_backend("reference"))
    # A: k // 2 new tokens over the cached prefix (windows up to k - 1), B: k - 2 from scratch, C: one.
    reqs = [([0], prefix, k // 2), ([3], 0, k - 2), ([6], 0, 1)]
    ids = torch.cat([tokens[prefix:prefix + k // 2], tokens[20:20 + k - 2], tokens[40:41]])

    def run():
        log: list = []
        b = _with_tokens(_batch(reqs), ids)
        hidden = tiny(b, cache, _recording(log))
        sets = [ctx.local(idx[:, 0])[1].sort(dim=1).values for ctx, idx in zip(b.packed_contexts() * len(log), log)]
        return hidden, sets, [idx.shape[-1] for idx in log]

    hidden, sets, widths = run()
    assert set(widths) == {k - 1}  # the widest window (A's last token), not top-k
    monkeypatch.setattr(PackedContext, "max_window", property(lambda self: 1 << 30))
    hidden_scored, sets_scored, widths_scored = run()
    assert set(widths_scored) == {k}
    torch.testing.assert_close(hidden, hidden_scored, rtol=1e-5, atol=1e-5)
    for got, want in zip(sets, sets_scored):
        w = max(got.shape[1], want.shape[1])
        # -1 pads sort first; compare the sets as the last columns of the sorted rows
        assert torch.equal(_pad_cols(got, w).sort(dim=1).values, _pad_cols(want, w).sort(dim=1).values), SEED
