"""Why two-batch overlap is refused with DSA top-k sharing (DESIGN.md's controller rule).

A shared layer (GLM-5: ``index_topk_freq`` / ``index_topk_pattern``) attends to the top-k positions an
earlier layer selected. `models.two_batch` runs each micro-batch as a whole forward, so a shared layer
reuses its own micro-batch's selection. Were the selection a step-wide buffer that interleaved
micro-batches fill in turn, a shared layer of one micro-batch could read the other's: its tokens would
attend to the other request's cache slots. This test feeds a shared layer the other micro-batch's
selection and shows the output goes wrong, where its own selection reproduces the whole forward.
"""

from __future__ import annotations

import torch

from models.batch import ForwardMode
from models.tiny import make_tiny
from models.two_batch import split_batch
from tests.workers.prompts import random_prompt
from workers.model_runner import WorkItem
from workers.page_pool import PagePool
from workers.rank_build import RankSpec, build_rank


def _micro_forward(model, micro, cache, backend, crossed=None):
    """The layers of ``model`` over ``micro`` as `DsaForCausalLM._forward` runs them; returns (normed hidden,
    each layer's selection). ``crossed``: selections of the other micro-batch, fed to the shared layers."""
    x = model.embed_tokens(micro.input_ids)
    cos, sin = model.rotary(micro.positions, x.dtype)
    selected, made = None, []
    plan = model.cfg.topk_plan
    for i, layer in enumerate(model.layers):
        given = selected if crossed is None or plan.computes[i] else crossed[plan.source[i]]
        x, selected = layer(x, cos, sin, micro, cache, i, backend, given)
        made.append(selected)
    return model.norm(x), made


@torch.inference_mode()
def test_a_shared_layer_fed_the_other_micro_batchs_topk_goes_wrong(tmp_path):
    tiny = make_tiny("glm_moe_dsa", tmp_path / "glm", seed=7)
    rank = build_rank(RankSpec(str(tiny), num_pages=16))
    model, runner = rank.model, rank.runner
    plan = model.cfg.topk_plan
    assert plan.has_sharing and not plan.computes[1]
    # Two prompts of one length (the selections have one shape) longer than index_topk (16): the
    # selection picks among the context.
    n = 40
    pool = PagePool(16)
    items = [WorkItem(tuple(random_prompt(n, 300, seed)), 0, tuple(pool.allocate_for_tokens(n))) for seed in (1, 2)]
    batch = runner.build_batch(ForwardMode.PREFILL, items)
    whole = model(batch, rank.cache, runner.backend)
    first, second = split_batch(batch, 1)
    _, first_sel = _micro_forward(model, first, rank.cache, runner.backend)
    own, _ = _micro_forward(model, second, rank.cache, runner.backend)
    crossed, _ = _micro_forward(model, second, rank.cache, runner.backend, crossed=first_sel)
    torch.testing.assert_close(own, whole[n:], rtol=1e-5, atol=1e-5)
    # The other request's slots: its keys, not this request's.
    assert not torch.equal(first_sel[0].slots, _micro_forward(model, second, rank.cache, runner.backend)[1][0].slots)
    err = float((crossed - whole[n:]).abs().max() / whole[n:].abs().max())
    assert err > 0.05, f"a shared layer fed the other micro-batch's top-k changed the output by only {err:.2e}"
    argmax_own = model.logits(own).argmax(-1)
    argmax_crossed = model.logits(crossed).argmax(-1)
    print(f"crossed top-k: max rel err {err:.3f}, next-token argmax differs at "
          f"{int((argmax_own != argmax_crossed).sum())} of {n} positions")
