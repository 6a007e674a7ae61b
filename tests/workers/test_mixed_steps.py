"""A decode batch riding along with an arriving prompt's prefill in one forward (`Engine._prefill`), on CPU
through the rows graphs' static buffers (the code a CUDA graph captures, run eagerly): every request's greedy
output equals the plain engine's (each prompt alone), and the steps that mixed are the ones that could."""

from __future__ import annotations

import pytest

from models.tiny import make_tiny
from tests.workers.mixed_arrivals import drive_arrivals
from tests.workers.prompts import random_prompt
from workers.decode_graphs import default_graph_context
from workers.offline import LLM
from workers.request import Request
from workers.sample.params import SamplingParams

TOPK = 160
NEW = 8


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def tiny(request, tmp_path_factory):
    return make_tiny(request.param, tmp_path_factory.mktemp(f"mixed-{request.param}"), seed=6, index_topk=TOPK)


def _engine(tiny, graphs: bool, k: int = 0) -> LLM:
    llm = LLM(tiny, mtp_draft_tokens=k, max_batch_size=8, chunk_size=256, num_pages=96)
    if graphs:
        llm.engine.enable_cuda_graphs(default_graph_context(llm.cfg, llm.pool.num_pages), capture=False,
                                      prefill_tokens=TOPK)
    return llm


@pytest.mark.parametrize("k", [0, 1])
def test_decode_rides_along_with_arriving_prompts(tiny, k):
    base = random_prompt(130, 300, 7)
    early = [random_prompt(n, 300, 70 + n) for n in (20, 45)]              # decoding when the others arrive
    late = [random_prompt(30, 300, 8), base + random_prompt(12, 300, 9)]   # a new prompt; a prefix hit
    together = [random_prompt(14, 300, 13), random_prompt(9, 300, 14)]     # two new prompts in one step
    plain = _engine(tiny, graphs=False, k=k)
    plain.generate([base], max_new_tokens=1, ignore_eos=True)  # the same cache state in both engines
    want = [plain.generate([p], max_new_tokens=NEW, ignore_eos=True)[0] for p in early + late + together]

    llm = _engine(tiny, graphs=True, k=k)
    llm.generate([base], max_new_tokens=1, ignore_eos=True)
    reqs, mixed = drive_arrivals(llm.engine, early, late, together, NEW)
    assert [r.output for r in reqs] == want
    # MTP verifies with drafts: its decode batch never rides along. Without MTP the prefix hit's step and the two
    # prompts' step mixed (rows graphs); the lone new prompt kept its own graph and the decode batch its own.
    assert mixed == (0 if k else 2)
    assert llm.pool.free_count == llm.pool.num_pages


def test_a_step_the_rows_graphs_cannot_take_stays_two_forwards(tiny):
    """A prompt longer than the rows graphs take (here: wider than the largest bucket) is prefilled in a forward
    of its own, the decode batch in another; outputs unchanged."""
    plain = _engine(tiny, graphs=False)
    prompts = [random_prompt(20, 300, 11), random_prompt(250, 300, 12)]
    want = [plain.generate([p], max_new_tokens=NEW, ignore_eos=True)[0] for p in prompts]
    llm = _engine(tiny, graphs=True)
    eng = llm.engine
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    first = Request("a", prompts[0], params)
    eng.add_request(first)
    while not first.output:
        eng.step()
    second = Request("b", prompts[1], params)
    eng.add_request(second)
    while eng.has_work:
        eng.step()
    eng.flush()
    assert [first.output, second.output] == want and eng.stats.mixed_steps == 0
