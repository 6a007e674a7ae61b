"""Overlap scheduling: a pure-decode step is launched before the previous one is
read back, and its input tokens come from the device. Outputs, pages and aborts
must be exactly those of the step-by-step engine."""

from __future__ import annotations

import json
import re

import pytest

from models.tiny import make_tiny
from tests.workers.prompts import random_prompt
from workers.offline import LLM
from workers.page_pool import PagePool
from workers.request import Request
from workers.sample.params import SamplingParams
from workers.structured import GrammarSpec


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny("deepseek_v32", tmp_path_factory.mktemp("overlap") / "m", seed=3)


def _run(llm, reqs, abort_at=None):
    """Step ``llm``'s engine until idle; returns every output per request id and the launched-ahead count."""
    eng = llm.engine
    for r in reqs:
        assert eng.add_request(r) is None
    got = {r.request_id: [] for r in reqs}
    ahead = 0
    while eng.has_work:
        if abort_at is not None and eng.stats.steps == abort_at[1]:
            eng.abort(abort_at[0])
        for o in eng.step():
            got[o.request_id].append(o)
        ahead += eng._inflight is not None
    return got, ahead


def _requests(stop_token: int | None):
    # Different lengths and limits: rows finish at different steps; one stops on a token id
    # (the engine learns it only at the read-back, after launching the next step).
    out = []
    for i, (n, m) in enumerate([(5, 9), (70, 4), (12, 12)]):
        params = SamplingParams(max_new_tokens=m, ignore_eos=True, temperature=0.8 if i == 2 else 0.0, seed=7 + i,
                                stop_token_ids=(stop_token,) if stop_token is not None and i == 0 else ())
        out.append(Request(f"r{i}", random_prompt(n, 300, 20 + i), params))
    return out


@pytest.mark.parametrize("static", [False, True])
def test_overlapped_steps_emit_what_the_step_by_step_engine_does(tiny, static):
    want_llm = LLM(tiny, overlap_scheduling=False, chunk_size=128)
    want, _ = _run(want_llm, _requests(None))
    # Stop request 0 at (the first occurrence of) its 4th token: a step for it is in flight then.
    stop = want["r0"] and [t for o in want["r0"] for t in o.token_ids][3]
    want, _ = _run(LLM(tiny, overlap_scheduling=False, chunk_size=128), _requests(stop))
    llm = LLM(tiny, chunk_size=128)
    if static:  # the persistent decode inputs, with the in-flight tokens patched in on the device
        llm.engine.enable_cuda_graphs(max_context=512, capture=False)
    got, ahead = _run(llm, _requests(stop))
    assert ahead > 5  # steps really were launched ahead of their read-back

    def flat(outs):
        return ([t for o in outs for t in o.token_ids], [round(x, 5) for o in outs for x in o.logprobs],
                outs[-1].finish_reason)

    assert {k: flat(v) for k, v in got.items()} == {k: flat(v) for k, v in want.items()}
    assert flat(got["r0"])[2] == "stop" and len(flat(got["r0"])[0]) < 9
    assert all(sum(o.finished for o in v) == 1 and v[-1].finished for v in got.values())
    assert llm.pool.free_count == llm.pool.num_pages and llm.pool.held_count == 0


def test_abort_with_a_step_in_flight_holds_its_pages_until_that_step_ran(tiny):
    llm = LLM(tiny, chunk_size=128)
    reqs = _requests(None)
    got, _ = _run(llm, reqs, abort_at=("r2", 5))
    assert got["r2"] and not any(o.token_ids for o in got["r2"][-1:] if o.finished)
    assert reqs[2].finish_reason.value == "abort" and len(reqs[2].output) < 12
    assert llm.pool.free_count == llm.pool.num_pages and llm.pool.held_count == 0


def test_pool_holds_frees_until_their_step_completed():
    pool = PagePool(8)
    a, b = pool.allocate(2), pool.allocate(3)
    pool.hold_frees(1)
    pool.free(a)
    pool.hold_frees(2)
    pool.free(b)
    assert pool.free_count == 3 and pool.held_count == 5
    pool.release_held(1)
    assert pool.free_count == 5 and pool.held_count == 3
    pool.hold_frees(None)
    pool.release_held()
    assert pool.free_count == 8 and pool.held_count == 0
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(a)


# A bounded JSON object, a regex and a choice: each completes within MAX_CONSTRAINED tokens (the tiny
# byte-level tokenizer writes a character per token), at different steps.
GRAMMARS = [GrammarSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 99}},
                                     "required": ["n"], "additionalProperties": False}),
            GrammarSpec("regex", r"[a-z]{2,4}\."),
            GrammarSpec.choice(["yes", "no thanks"])]
MAX_CONSTRAINED = 12


def _mixed_requests():
    """Unconstrained rows (seeded, greedy) between constrained ones (greedy, seeded, greedy), one batch."""
    out = []
    for i in range(5):
        grammar = GRAMMARS[i // 2] if i % 2 == 0 else None  # rows 0, 2, 4 constrained
        params = SamplingParams(max_new_tokens=MAX_CONSTRAINED if grammar else 7 + i, ignore_eos=grammar is None,
                                temperature=0.9 if i in (1, 2) else 0.0, seed=11 + i, grammar=grammar)
        out.append(Request(f"m{i}", random_prompt(6 + 3 * i, 250, 40 + i), params))
    return out


def test_constrained_rows_overlap_and_emit_what_the_step_by_step_engine_does(tiny):
    """A batch with constrained requests keeps overlap scheduling (each launch reads the step in flight
    back before the grammar masks, while its forward runs); every row's tokens, logprobs and finish
    are the step-by-step engine's, the constrained outputs match their grammars, and every page
    comes back (a constrained row that completes has one step computed and dropped)."""
    want, _ = _run(LLM(tiny, overlap_scheduling=False, chunk_size=128), _mixed_requests())
    llm = LLM(tiny, chunk_size=128)
    got, ahead = _run(llm, _mixed_requests())
    assert ahead > 5  # launched ahead while constrained rows ran (before: never)

    def flat(outs):
        return [t for o in outs for t in o.token_ids], outs[-1].finish_reason

    assert {k: flat(v) for k, v in got.items()} == {k: flat(v) for k, v in want.items()}
    for k in want:  # a launched-ahead row that ended changes a step's batch: fp32 sums, not tokens
        assert [x for o in got[k] for x in o.logprobs] == pytest.approx([x for o in want[k] for x in o.logprobs],
                                                                         abs=1e-4), k
    tok = llm.engine.grammars.tokenizer
    texts = {k: tok.decode(flat(v)[0]) for k, v in got.items()}
    assert 0 <= json.loads(texts["m0"])["n"] <= 99
    assert re.fullmatch(GRAMMARS[1].value, texts["m2"]), texts["m2"]
    assert texts["m4"] in ("yes", "no thanks")
    assert all(flat(got[k])[1] == "stop" for k in ("m0", "m2", "m4"))
    assert all(sum(o.finished for o in v) == 1 and v[-1].finished for v in got.values())
    assert llm.pool.free_count == llm.pool.num_pages and llm.pool.held_count == 0
