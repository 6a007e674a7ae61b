"""DeepSeek-V4 speculative decoding with its MTP layer through the engine (reference backend).

Greedy MTP equals greedy without it, token for token and logprob for logprob, at 1, 2 and 3 drafts, on
an MTP-friendly checkpoint (`tests.workers.v4_mtp_friendly`: every acceptance length runs) and on the
random one `dsa-pd make-tiny` writes; in PD (the MTP layer's keys of the prompt pushed with the other
pages), with fp8 caches and under preemption. The drafts are the MTP layer's (the standalone
`models.v4.mtp.mtp_step` gives the same), and a draft writes exactly the cache positions the
draft-slot layout helper of the CUDA-graph path (`workers.mtp.draft_slot_layout`) names, and reads
nothing it did not write.
"""

from __future__ import annotations

import pytest
import torch

from models.registry import load_any_model
from models.v4.mtp import mtp_step
from tests.workers.prompts import random_prompt
from tests.workers.v4_mtp_friendly import make_v4_mtp_friendly
from workers.mtp import draft_slot_layout
from workers.offline import LLM
from workers.v4_mtp_draft import V4Drafter

LENGTHS = (1, 9, 40, 23, 261)  # as test_v4_engine.py: windows, compressed blocks and a 256-token page crossed
NEW = 16

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def friendly(tmp_path_factory):
    return make_v4_mtp_friendly(tmp_path_factory.mktemp("v4-mtp-friendly"))


@pytest.fixture(scope="module")
def prompts():
    return [random_prompt(n, 300, n) for n in LENGTHS]


def _greedy(llm: LLM, prompts) -> tuple[list[list[int]], list[list[float]]]:
    reqs = llm.logprob_requests(prompts, max_new_tokens=NEW, prompt_logprobs=None, ignore_eos=True)
    return [r.output for r in reqs], [r.logprobs for r in reqs]


@pytest.fixture(scope="module")
def baseline(friendly, prompts):
    return _greedy(LLM(friendly, num_pages=8, chunk_size=16), prompts)


def _same(got, want) -> None:
    """Same tokens; logprobs equal up to float32 rounding (a verify forward batches k + 1 positions where plain
    decode runs one: a compressor state read back wrong would move them by far more)."""
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-4)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_mtp_equals_greedy(friendly, prompts, baseline, k):
    llm = LLM(friendly, num_pages=8, chunk_size=16, mtp_draft_tokens=k)
    assert isinstance(llm.engine.drafter, V4Drafter)
    _same(_greedy(llm, prompts), baseline)
    st = llm.stats()
    hist = st["mtp_accepted_histogram"]
    # Every acceptance length happened: rejections (the verify ran past what is kept), partial and full.
    assert set(hist) == set(range(k + 1)), hist
    assert 0 < st["mtp_accepted"] < st["mtp_drafted"]
    assert st["pool_free_pages"] == st["pool_total_pages"]


def test_greedy_mtp_on_the_made_tiny_checkpoint(tiny_v4, prompts):
    """`dsa-pd make-tiny --arch deepseek_v4` writes a random MTP layer: it drafts (rarely well), and greedy
    output is the same."""
    want = _greedy(LLM(tiny_v4, num_pages=8, chunk_size=16), prompts)
    llm = LLM(tiny_v4, num_pages=8, chunk_size=16, mtp_draft_tokens=2)
    _same(_greedy(llm, prompts), want)
    assert llm.stats()["mtp_drafted"] > 0 and len(llm.model.mtp) == 1


def _record_draft_logits(monkeypatch) -> list[torch.Tensor]:
    """The logits every draft step of a V4 drafter made from now on samples from (in order)."""
    import workers.v4_mtp_draft as v4_draft

    logits: list[torch.Tensor] = []

    class Recording(v4_draft.DraftSampler):
        def __call__(self, x):
            logits.append(x.clone())
            return super().__call__(x)

    monkeypatch.setattr(v4_draft, "DraftSampler", Recording)
    return logits


def test_drafts_are_the_mtp_layers(tiny_v4, monkeypatch):
    """The first verify's draft logits are the standalone MTP layer's: its entries over the prompt with the
    tokens after each position (the last: token 1), then chained steps at the next positions (rotated there).
    On the random checkpoint (the friendly one's MTP block outputs nothing, so positions would not show)."""
    logits = _record_draft_logits(monkeypatch)
    k, p = 3, random_prompt(23, 300, 23)
    llm = LLM(tiny_v4, num_pages=8, chunk_size=16, mtp_draft_tokens=k)
    t1 = llm.generate([p], max_new_tokens=2, ignore_eos=True)[0][0]
    model = load_any_model(tiny_v4, dtype=torch.float32)
    with torch.inference_mode():
        h = model(torch.tensor(p), [len(p)], [model.new_state()])
        ms = model.new_mtp_state()
        x = mtp_step(model, 0, torch.tensor(p[1:] + [t1]), h, [len(p)], [ms])[-1:]
        want = [model.mtp_logits(x)]
        for _ in range(k - 1):
            x = mtp_step(model, 0, want[-1].argmax(-1), x, [1], [ms])
            want.append(model.mtp_logits(x))
    assert ms.seq_len == len(p) + k - 1  # the chained steps sat at positions n, n + 1: num_tokens - 1 + s
    torch.testing.assert_close(torch.cat(logits[:k]), torch.cat(want), rtol=0, atol=1e-4)


def test_draft_writes_where_the_draft_layout_says(friendly, prompts):
    """Every draft writes the MTP layer's keys of its pending positions and of its chained steps at the slots
    `draft_slot_layout` (the CUDA-graph path's helper) gives for the swa pages, from ``num_tokens - 1``, and
    nothing else. Poisoning every position from ``pending_start`` on changes no draft: a draft reads only
    keys written with their true next token, or by itself."""
    k = 3
    want = LLM(friendly, num_pages=8, chunk_size=16, mtp_draft_tokens=k)
    want_out = _greedy(want, prompts)
    llm = LLM(friendly, num_pages=8, chunk_size=16, mtp_draft_tokens=k)
    cache = llm.runner.cache
    T = cache.layouts["swa"].group.tokens_per_page
    keys = cache.view("swa")[:, cache.layer_slot["swa"][llm.cfg.num_hidden_layers]]  # the MTP layer's [P, T, D]
    draft, calls = llm.engine.drafter.draft, []

    def checking(reqs, meta):
        expect = set()
        for r in reqs:
            pages = r.page_table.pages["swa"]
            for pos in range(r.pending_start, len(pages) * T):
                keys[pages[pos // T], pos % T] = float("nan")
            expect |= {pages[pos // T] * T + pos % T
                       for pos in range(r.pending_start, r.pending_start + r.pending_hidden.shape[0])}
        width = max(len(r.page_table.pages["swa"]) for r in reqs)
        tables = torch.tensor([r.page_table.pages["swa"] + [0] * (width - len(r.page_table.pages["swa"]))
                               for r in reqs])
        layout = draft_slot_layout(tables, torch.tensor([r.num_tokens - 1 for r in reqs]), k - 1, page_size=T)
        expect |= set(layout.flatten().tolist())
        before = keys.reshape(-1, keys.shape[-1]).clone()
        out = draft(reqs, meta)
        after = keys.reshape(-1, keys.shape[-1])
        poisoned = before.isnan().all(-1)
        written = set((poisoned & ~after.isnan().any(-1)).nonzero().flatten().tolist())
        assert written == expect
        assert torch.equal(after[~poisoned], before[~poisoned])
        calls.append(len(reqs))
        return out

    llm.engine.drafter.draft = checking
    _same(_greedy(llm, prompts), want_out)
    assert llm.stats()["mtp_accepted_histogram"] == want.stats()["mtp_accepted_histogram"]
    assert len(calls) > 5 and max(calls) >= 3  # batched drafts of several requests


def test_pd_with_mtp_equals_monolithic(friendly, tiny_v4, prompts, baseline, monkeypatch):
    """Prefill writes the MTP layer's keys of the prompt (all but its last position) and pushes them with the
    swa pages; decode's first draft writes the last one. Greedy output is the same, and so are the drafts'
    logits (on the random checkpoint, whose MTP block attends: keys not pushed would change them)."""
    llm = LLM(friendly, num_pages=8, chunk_size=16, mtp_draft_tokens=2, pd=True)
    _same(_greedy(llm, prompts), baseline)
    assert set(llm.stats()["mtp_accepted_histogram"]) == {0, 1, 2}
    for pools in (llm.pd.prefill.pool, llm.pd.decode.pool):
        # Free, or held only by the prefix cache (reclaimable).
        assert pools.free_counts() == {g: p.num_pages for g, p in pools.pools.items()}
    runs = []
    for pd in (False, True):
        logits = _record_draft_logits(monkeypatch)
        LLM(tiny_v4, num_pages=8, chunk_size=16, mtp_draft_tokens=2, pd=pd).generate(prompts[2:3], max_new_tokens=8,
                                                                                    ignore_eos=True)
        runs.append(torch.cat(logits))
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=1e-4)


def test_fp8_caches_with_mtp(friendly, prompts):
    """The MTP layer's keys go through the 584-byte V4 format like the main layers'."""
    want = _greedy(LLM(friendly, num_pages=8, chunk_size=16, kv_cache_dtype="fp8"), prompts)
    _same(_greedy(LLM(friendly, num_pages=8, chunk_size=16, kv_cache_dtype="fp8", mtp_draft_tokens=3), prompts), want)


def test_preemption_with_mtp(friendly):
    """Two 250-token prompts with 3 pages per group: the newer one is preempted while drafting (its pages of
    every group freed, its pending state dropped) and resumes as if alone. The prefix cache off: with its cut state
    pages the pools run short at another point, and this schedule preempts nothing."""
    ps = [random_prompt(250, 300, 7), random_prompt(250, 300, 8)]
    alone = [LLM(friendly, num_pages=8).generate([p], max_new_tokens=12, ignore_eos=True)[0] for p in ps]
    llm = LLM(friendly, num_pages=3, chunk_size=512, mtp_draft_tokens=2, prefix_caching=False)
    assert llm.generate(ps, max_new_tokens=12, ignore_eos=True) == alone
    st = llm.stats()
    assert st["preemptions"] >= 1 and st["pool_free_pages"] == st["pool_total_pages"]


@pytest.mark.parametrize("pd", [False, True])
def test_mtp_with_the_prefix_cache_equals_greedy_uncached(friendly, pd):
    """MTP drafts and the prefix cache together (`workers.v4_prefix`) are lossless: greedy with 3 drafts and the
    cache on equals greedy without drafts and with the cache off, tokens and logprobs, over three turns of one
    conversation. Turn 1's verify steps cross the cut at 256 (with drafts rejected before it: their rows
    reach the cut's state page and are rewritten by the forward that next crosses it); turn 2 reuses that cut
    and its prefill crosses 512 in a chunk from 510 (the cut's block [508, 512) begins before the forward:
    its first rows come from the loaded state); turn 3 reuses 512."""
    turns = [random_prompt(250, 300, 11)]
    want_llm = LLM(friendly, num_pages=16, chunk_size=256, prefix_caching=False)
    # Chunks such that turn 2's prefill (monolithic: from the cut 256; PD: prefill from 0) starts one at 510.
    llm = LLM(friendly, num_pages=16, chunk_size=102 if pd else 127, mtp_draft_tokens=3, pd=pd)
    hits = []
    for extra in (270, 40, None):
        want = _greedy(want_llm, turns[-1:])
        before = llm.stats()["prefix_cache_hits"]
        _same(_greedy(llm, turns[-1:]), want)
        hits.append(llm.stats()["prefix_cache_hits"] - before)
        if extra is not None:
            turns.append(turns[-1] + want[0][0] + random_prompt(extra, 300, 12 + extra))
    assert hits == [0, 256, 512], hits
    st = llm.stats()
    assert 0 in st["mtp_accepted_histogram"] and 0 < st["mtp_accepted"] < st["mtp_drafted"]
    assert st["pool_free_pages"] == st["pool_total_pages"]
