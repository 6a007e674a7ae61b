"""The fixed-width MTP draft (`workers.mtp_draft.FixedWidthDrafter`) against the extend draft it
replaced (`ExtendDrafter`, the spec), and through its static buffers (the CUDA-graph path, run
eagerly on CPU: `workers.draft_graphs`).

Greedy MTP equal to greedy without MTP, with and without top-k reuse, in PD, under grammars and
with overlap scheduling is checked by test_engine.py, test_pd.py, test_structured_engine.py and
test_overlap.py, all of which now draft through the fixed-width path. Here: the same drafts (so the
same acceptance histogram) and the same MTP cache contents as the extend path, step for step.
"""

from __future__ import annotations

import pytest
import torch

from tests.workers.mtp_friendly import make_mtp_friendly
from tests.workers.prompts import random_prompt
from workers.decode_graphs import default_graph_context
from workers.mtp import draft_slot_layout
from workers.mtp_draft import ExtendDrafter, chain_draft_batch, first_draft_batch, first_draft_rows
from workers.offline import LLM
from workers.request import Request
from workers.sample.params import SamplingParams

# A page boundary crossed during decode (60 + new tokens), exactly one page, one token.
LENGTHS = (1, 60, 64, 130, 9)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = make_mtp_friendly(arch, tmp_path_factory.mktemp(f"draft-{arch}"))
        return made[arch]
    return get


def test_first_and_chained_draft_batches_use_the_draft_layout():
    page_tables = torch.tensor([[3, 7, 0], [5, 2, 9], [0, 0, 0]], dtype=torch.int32)
    starts = torch.tensor([62, 10, 0])
    counts = torch.tensor([2, 3, 0])  # request 2 is a padding row
    tokens = torch.arange(9)
    b = first_draft_batch(page_tables, starts, counts, tokens, 3, 200)
    assert b.decode_width() == 3 and b.seq_lens.tolist() == [65, 13, 3]
    assert b.positions.tolist() == [62, 63, 64, 10, 11, 12, 0, 1, 2]
    # Past each request's count nothing is written; request 0 crosses into page 7 (unwritten there).
    assert b.out_slots.tolist() == [3 * 64 + 62, 3 * 64 + 63, -1, 5 * 64 + 10, 5 * 64 + 11, 5 * 64 + 12, -1, -1, -1]
    assert first_draft_rows(counts, 3).tolist() == [1, 5, 6]
    first = starts + counts + 1
    live = counts > 0
    layout = draft_slot_layout(page_tables, first, 2)
    for step in range(2):
        c = chain_draft_batch(page_tables, first, live, step, 2, tokens[:3], 200)
        assert c.positions.tolist() == (first + step).tolist() and c.seq_lens.tolist() == (first + step + 1).tolist()
        assert c.out_slots.tolist() == [*layout[step, :2].tolist(), -1]
    assert c.out_slots[0] == 7 * 64 + 2  # step 1 of request 0: position 66, page 7


def _run_steps(llm: LLM, reqs: list[Request], steps: int | None = None) -> None:
    for r in reqs:
        assert llm.engine.add_request(r) is None
    n = 0
    while llm.engine.has_work and (steps is None or n < steps):
        llm.engine.step()
        n += 1


def _requests(greedy_only: bool = True) -> list[Request]:
    out = []
    for i, n in enumerate(LENGTHS):
        sampled = not greedy_only and i % 2 == 1
        params = SamplingParams(max_new_tokens=8 + 2 * i, ignore_eos=True, temperature=0.8 if sampled else 0.0,
                                top_k=40 if sampled else 0, seed=100 + i)
        out.append(Request(f"d{i}", random_prompt(n, 300, 70 + n), params))
    return out


@pytest.mark.parametrize("arch,k,reuse", [("deepseek_v32", 2, False), ("glm_moe_dsa", 3, True)])
def test_fixed_width_draft_equals_the_extend_draft(ckpts, arch, k, reuse):
    """Same tokens, same acceptance histogram, and the same MTP-layer cache -- every slot of it, so the
    positions past each request's accepted ones were not written (the chained steps read one of them)."""
    ckpt = ckpts(arch)
    runs = []
    for spec in (False, True):
        llm = LLM(ckpt, mtp_draft_tokens=k, mtp_topk_reuse=reuse, chunk_size=64, max_batch_size=8)
        if spec:
            llm.engine.drafter = ExtendDrafter(llm.runner, k, reuse)
        reqs = _requests()
        _run_steps(llm, reqs)
        layer = llm.cfg.num_hidden_layers  # the MTP layer's cache
        runs.append(([r.output for r in reqs], llm.stats()["mtp_accepted_histogram"],
                     llm.cache.read_mla(layer, torch.arange(llm.cache.spec.num_slots)),
                     llm.cache.read_index(layer, torch.arange(llm.cache.spec.num_slots))))
        assert llm.pool.free_count == llm.pool.num_pages
    (out, hist, mla, index), (want_out, want_hist, want_mla, want_index) = runs
    assert out == want_out
    assert hist == want_hist
    assert len(hist) >= 3 and 0 in hist, hist  # rejections and partial acceptance happened
    # Equal up to GEMM rounding: the rows of a wider batch round differently on CPU (~1e-7 here).
    torch.testing.assert_close(mla, want_mla, rtol=0, atol=1e-5)
    torch.testing.assert_close(index, want_index, rtol=0, atol=1e-5)
    assert mla.abs().sum() > 0


@pytest.mark.parametrize("arch,k", [("deepseek_v32", 2), ("glm_moe_dsa", 1)])
def test_static_draft_buffers_equal_eager_drafts(ckpts, arch, k):
    """The draft forwards through the static buffers the CUDA graphs capture (eagerly here) give what
    the eager fixed-width draft gives, with greedy and seeded rows mixed, top-k reuse, and a batch that
    shrinks (rows move, padding rows stay silent)."""
    ckpt = ckpts(arch)
    want_llm = LLM(ckpt, mtp_draft_tokens=k, mtp_topk_reuse=True, chunk_size=64, max_batch_size=5)
    want = _requests(greedy_only=False)
    _run_steps(want_llm, want)
    llm = LLM(ckpt, mtp_draft_tokens=k, mtp_topk_reuse=True, chunk_size=64, max_batch_size=5)
    llm.engine.enable_cuda_graphs(max_context=default_graph_context(llm.cfg, llm.pool.num_pages), capture=False)
    graphs = llm.engine.drafter.graphs
    assert graphs is not None and graphs.plan.batch_sizes == (1, 2, 4, 5)
    seen = []
    run = graphs.run

    def recording_run(drafter, reqs, pending, sampler):
        rows = graphs.inputs.assign([r.request_id for r in reqs], [r.page_table for r in reqs])
        seen.append((len(reqs), rows == list(range(len(reqs)))))
        return run(drafter, reqs, pending, sampler)

    graphs.run = recording_run
    got = _requests(greedy_only=False)
    _run_steps(llm, got)
    assert [r.output for r in got] == [r.output for r in want]
    assert llm.stats()["mtp_accepted_histogram"] == want_llm.stats()["mtp_accepted_histogram"]
    sizes = {n for n, _ in seen}
    assert len(sizes) >= 3 and any(not in_order for _, in_order in seen), seen  # buckets padded, rows moved
    assert llm.pool.free_count == llm.pool.num_pages
