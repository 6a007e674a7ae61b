"""The DeepSeek-V4 MTP layer (models/v4/mtp.py): built from and loaded with the checkpoint's ``mtp.0.*``
tensors, refused clearly when a declared one is missing, absent when the config declares none; its
paged forward (the engine's) equals its standalone form over any chunking.

transformers builds no V4 MTP layer, so there is nothing to compare its output with; the engine tests
(tests/workers/test_v4_mtp.py) show greedy MTP equals greedy.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from attention.group_cache import GroupedPagedCache
from models.batch import ForwardMode
from models.registry import load_any_model
from models.tiny_v4 import make_tiny_v4
from models.v4.batch import V4Batch
from models.v4.cache_spec import v4_cache_groups, v4_group_layouts
from models.v4.config import SLIDING
from models.v4.loader import v4_module_name
from models.v4.mtp import mtp_step
from models.weights import INDEX_FILE
from tests.workers.prompts import random_prompt
from workers.model_runner import WorkItem
from workers.page_tables import GroupPagePools
from workers.v4_runner import V4ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_v4(tmp_path_factory.mktemp("v4-mtp"))


def _tensors(path) -> dict[str, torch.Tensor]:
    files = sorted(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values()))
    return {n: t for f in files for n, t in load_file(str(path / f)).items()}


def test_mtp_weights_round_trip(tiny):
    """Every ``mtp.0.*`` tensor the tiny checkpoint holds lands in ``model.mtp[0]`` (the experts in their stacked
    weights), and the layer is what DeepSeek builds: a sliding-window block with a learned-routing MoE."""
    model = load_any_model(tiny, dtype=torch.float32)
    cfg = model.cfg
    assert cfg.num_nextn_predict_layers == 1 and len(model.mtp) == 1 and model.num_cache_layers == 5
    mtp = model.mtp[0]
    assert mtp.attn.kind == SLIDING and mtp.attn.compressor is None and mtp.attn.indexer is None
    assert not mtp.ffn.gate.hashed and mtp.attn.rope_label == "main"
    params = dict(model.named_parameters())
    ckpt = {n: t for n, t in _tensors(tiny).items() if n.startswith("mtp.")}
    assert {"mtp.0.enorm.weight", "mtp.0.hnorm.weight", "mtp.0.e_proj.weight", "mtp.0.h_proj.weight",
            "mtp.0.norm.weight", "mtp.0.hc_head_fn", "mtp.0.hc_head_base", "mtp.0.hc_head_scale",
            "mtp.0.attn.wkv.weight", "mtp.0.attn_norm.weight", "mtp.0.hc_attn_fn", "mtp.0.ffn.gate.bias"} <= set(ckpt)
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    for name, t in ckpt.items():
        target = v4_module_name(name, cfg)
        assert target is not None and target.startswith("mtp.0."), name
        if ".experts." in name and ".shared_experts." not in name:
            e, proj = int(name.split(".")[4]), name.split(".")[5]
            w13, w2 = mtp.ffn.experts.w13, mtp.ffn.experts.w2
            got = {"w1": w13[e, :I], "w3": w13[e, I:], "w2": w2[e]}[proj]
        else:
            got = params[target]
        torch.testing.assert_close(got, t.to(got.dtype).reshape(got.shape), rtol=0, atol=0)
    assert len([n for n in ckpt if ".experts." in n and ".shared_" not in n]) == 3 * E
    # The layer reads the main model's embedding and head: no copies of its own.
    assert not any(n.startswith(("mtp.0.embed", "mtp.0.head")) for n in params)


def test_a_declared_mtp_layer_must_be_in_the_checkpoint(tiny, tmp_path):
    """A checkpoint whose config declares ``num_nextn_predict_layers: 1`` but lacks one of its tensors is refused,
    naming the tensor; loading without the MTP layer (``with_mtp=False``) still works."""
    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    index = json.loads((bad / INDEX_FILE).read_text())
    shard = index["weight_map"].pop("mtp.0.h_proj.weight")
    tensors = load_file(str(bad / shard))
    del tensors["mtp.0.h_proj.weight"]
    save_file(tensors, str(bad / shard), metadata={"format": "pt"})
    (bad / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"lacks weights for: mtp\.0\.h_proj\.weight.*num_nextn_predict_layers 1"):
        load_any_model(bad, dtype=torch.float32)
    assert len(load_any_model(bad, dtype=torch.float32, with_mtp=False).mtp) == 0


def test_no_mtp_layer_declared_builds_none(tmp_path):
    """``num_nextn_predict_layers: 0``: no ``mtp.*`` tensors written, no MTP layer built, no MTP keys in the swa
    group, and an engine asked to draft refuses."""
    from workers.offline import LLM

    d = make_tiny_v4(tmp_path / "nomtp", num_nextn_predict_layers=0)
    assert not (d / INDEX_FILE).exists()
    assert not any(n.startswith("mtp.") for n in load_file(str(d / "model.safetensors")))
    model = load_any_model(d, dtype=torch.float32)
    assert len(model.mtp) == 0 and model.num_cache_layers == model.cfg.num_hidden_layers
    swa = {g.name: g for g in v4_cache_groups(model.cfg)}["swa"]
    assert swa.layers == tuple(range(model.cfg.num_hidden_layers))
    with pytest.raises(ValueError, match="needs a checkpoint with an MTP layer"):
        LLM(d, num_pages=4, mtp_draft_tokens=1)


def test_paged_mtp_forward_equals_the_standalone_layer(tiny):
    """The engine's MTP forward (keys loaded from and stored into the swa pages of cache layer
    ``num_hidden_layers``, ``model.mtp_forward``) over a prompt in uneven chunks equals `mtp_step` over it in
    one go; ``rows`` picks rows, ``draft=False`` computes no logits but still writes the keys."""
    model = load_any_model(tiny, dtype=torch.float32)
    cfg = model.cfg
    cache = GroupedPagedCache(v4_group_layouts(cfg, torch.float32), {g.name: 4 for g in v4_cache_groups(cfg)}, "cpu")
    runner = V4ModelRunner(model, cache, "cpu")
    pools = GroupPagePools(cache)
    p = random_prompt(40, 300, 40)
    table = pools.allocate_for_tokens(len(p) + 1).frozen()
    _, h = runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(p), 0, table)])
    with torch.inference_mode():
        whole = model(torch.tensor(p), [len(p)], [model.new_state()])
        torch.testing.assert_close(h, whole, rtol=1e-5, atol=1e-5)
        nxt = p[1:] + [7]
        want = model.mtp_logits(mtp_step(model, 0, torch.tensor(nxt), h, [len(p)], [model.new_mtp_state()]))
        got = []
        for s0, s1, draft in ((0, 9, False), (9, 10, True), (10, 31, True), (31, 40, True)):
            batch = V4Batch.of(ForwardMode.PREFILL, [nxt[s0:s1]], [s0], [table], "cpu")
            rows = torch.arange(s1 - s0)
            logits, out, sel = model.mtp_forward(batch, h[s0:s1], cache, draft=draft, rows=rows if s0 == 10 else None)
            assert sel is None and out.shape == (s1 - s0, cfg.hc_mult * cfg.hidden_size)
            if draft:
                got.append(logits)
            else:
                assert logits is None
                got.append(want[s0:s1])  # its keys are what the next chunks read
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="no top-k to reuse"):
        model.mtp_forward(batch, h[31:40], cache, reuse=object())
