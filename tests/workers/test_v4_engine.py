"""DeepSeek-V4 through the engine: paged cache groups, monolithic and PD over real NIXL (DRAM).

The tiny checkpoint is `dsa-pd make-tiny --arch deepseek_v4`'s (window 8, CSA every 4 tokens, HCA
every 8, index top-3): the prompts cross several windows, compressed blocks and a 256-token page.
"""

from __future__ import annotations

import pytest
import torch

from models.registry import load_any_model
from tests.workers.hf_tiny import use_tie_rule
from tests.workers.pd_aborts import abort_at_every_phase
from tests.workers.prompts import random_prompt
from tests.workers.v4_reference import standalone_greedy
from workers.decode_worker import DecodeWorker
from workers.offline import LLM
from workers.page_tables import PageTable

LENGTHS = (1, 9, 40, 23, 261)  # 261: past one 256-token page, ends mid compressed block of every ratio
NEW = 8


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference(tiny_v4):
    """Prompts and their greedy continuations by the standalone ``models.v4`` model."""
    model = load_any_model(tiny_v4, dtype=torch.float32)
    prompts = [random_prompt(n, 300, n) for n in LENGTHS]
    return prompts, standalone_greedy(model, prompts, NEW)


def test_engine_equals_standalone_and_transformers(tiny_v4, reference):
    from transformers import AutoModelForCausalLM

    prompts, standalone = reference
    # Chunks of 16 prompt tokens for all requests together, decode steps batched with prefill chunks.
    llm = LLM(tiny_v4, num_pages=8, chunk_size=16)
    assert llm.generate(prompts, max_new_tokens=NEW, ignore_eos=True) == standalone
    # A request's output does not depend on its batch.
    assert llm.generate(prompts[2:3], max_new_tokens=NEW, ignore_eos=True) == standalone[2:3]
    st = llm.stats()
    assert st["pool_free_pages"] == st["pool_total_pages"]
    assert isinstance(llm.pool.free_counts(), dict) and set(llm.pool.free_counts()) == {
        "swa", "csa_kv", "csa_index", "csa_state", "csa_index_state", "hca_kv", "hca_state"}
    hf = use_tie_rule(AutoModelForCausalLM.from_pretrained(tiny_v4, dtype=torch.float32).eval())
    with torch.no_grad():
        # Prompt logits through the pages: transformers' within float32 rounding.
        p = prompts[2]
        torch.testing.assert_close(llm.prompt_logits(p), hf(torch.tensor([p])).logits[0].float(), rtol=1e-4, atol=1e-4)
        for p, ours in list(zip(prompts, standalone))[:4]:
            ref = hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(p):].tolist()
            assert ours == ref, f"prompt of {len(p)} tokens"


def test_pages_per_group_follow_the_sequence(tiny_v4):
    """A request's pages: one per 256 tokens of the window keys (older pages kept), per 256 entries of a
    compressed cache, one state page per state group (without a prefix cache: with one, the CSA state
    groups hold a page per 256-token cut too, tests/workers/test_v4_prefix_cache.py)."""
    llm = LLM(tiny_v4, num_pages=8, prefix_caching=False)
    table = PageTable({g: [] for g in llm.pool.groups})
    assert llm.pool.grow(table, 261)
    assert {g: len(p) for g, p in table.pages.items()} == {
        "swa": 2, "csa_kv": 1, "csa_index": 1, "csa_state": 1, "csa_index_state": 1, "hca_kv": 1, "hca_state": 1}
    assert not llm.pool.grow(table, 8 * 256 + 1)  # 9 swa pages: all or nothing
    assert len(table.pages["swa"]) == 2
    ids = llm.pool.transfer_ids(table)
    assert llm.pool.cache.pages_of_units(ids) == table.pages
    llm.pool.free(table)
    assert llm.pool.free_count == llm.pool.num_pages


def test_pd_equals_monolithic_and_every_cache_group_counts(tiny_v4, reference, monkeypatch):
    prompts, standalone = reference
    llm = LLM(tiny_v4, num_pages=8, chunk_size=16, pd=True)
    assert llm.generate(prompts, max_new_tokens=NEW, ignore_eos=True) == standalone
    st = llm.stats()
    assert st["pool_free_pages"] == st["pool_total_pages"] == st["prefill_pool_free_pages"]
    abort_at_every_phase(llm.pd.prefill, llm.pd.decode)
    for pools in (llm.pd.prefill.pool, llm.pd.decode.pool):  # every group's pool whole, on both sides
        assert pools.free_counts() == {g: p.num_pages for g, p in pools.pools.items()}
    # The pushed pages are what decode continues from: wipe one state group's pages on arrival and the
    # output changes (the partially filled compressed blocks live there).
    admit = DecodeWorker._maybe_admit

    def wipe_state(self, a):
        if a.transfer_done and a.result is not None:
            view = self.engine.runner.cache.view("csa_state")
            for p in a.request.page_table.pages["csa_state"]:
                view[p].zero_()
        return admit(self, a)

    monkeypatch.setattr(DecodeWorker, "_maybe_admit", wipe_state)
    assert llm.generate(prompts, max_new_tokens=NEW, ignore_eos=True) != standalone


def test_preempted_requests_resume_from_fresh_pages(tiny_v4):
    """Two 250-token prompts grow past their first 256-token window page with 3 pages per group: the newer
    one is preempted (its pages of every group freed) and re-prefilled later; outputs as if alone."""
    prompts = [random_prompt(250, 300, 7), random_prompt(250, 300, 8)]
    alone = [LLM(tiny_v4, num_pages=8).generate([p], max_new_tokens=12, ignore_eos=True)[0] for p in prompts]
    llm = LLM(tiny_v4, num_pages=3, chunk_size=512)
    assert llm.generate(prompts, max_new_tokens=12, ignore_eos=True) == alone
    st = llm.stats()
    assert st["preemptions"] >= 1 and st["pool_free_pages"] == st["pool_total_pages"]
