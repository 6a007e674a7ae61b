"""The controller on DeepSeek-V4 configs: what TBO, top-k reuse and MTP mean for V4, and what its engine
runs today (deployments/controller/v4_rules.py)."""

from __future__ import annotations

import pytest

from deployments.app_config import AppConfig
from deployments.controller import check_args
from deployments.controller.rules import validate
from models.v4.config import V4Config
from tests.deployments.app_fixtures import merged, tiny_model, yaml_args


def _paths(args) -> dict[str, str]:
    return {v.path: v.message for v in check_args(args).violations}


def test_shipped_v4_configs_pass_with_a_v4_model_config():
    for name in ("tiny_v4_pd.yaml", "tiny_v4_mono.yaml", "tiny_v4_pd_gpu.yaml"):
        result = check_args(yaml_args(name))
        assert result.ok, result.violations
        assert isinstance(result.model_cfg, V4Config)


def test_mtp_drafts_are_accepted_with_the_models_mtp_layer():
    """DeepSeek-V4's MTP layer is built (models/v4/mtp.py): drafts pass where the checkpoint has the layer, both
    roles must agree on it, and a checkpoint without one refuses them naming the field."""
    base = yaml_args("tiny_v4_pd.yaml")
    both = merged(base, prefill={"mtp_draft_tokens": 2}, decode={"mtp_draft_tokens": 2})
    result = check_args(both)
    assert result.ok, result.violations
    assert result.model_cfg.num_nextn_predict_layers == 1
    mono = check_args(merged(yaml_args("tiny_v4_mono.yaml"), decode={"mtp_draft_tokens": 3}))
    assert mono.ok, mono.violations
    # One role drafting alone: the MTP layer's keys would be in one role's swa pages only.
    errs = _paths(merged(base, decode={"mtp_draft_tokens": 2}))
    assert "MTP is on for decode only" in errs["decode.mtp_draft_tokens"]
    no_mtp = tiny_model("deepseek_v4", num_nextn_predict_layers=0)
    errs = {v.path: v.message for v in validate(AppConfig.model_validate(both), no_mtp)}
    for role in ("prefill", "decode"):
        msg = errs[f"{role}.mtp_draft_tokens"]
        assert "mtp_draft_tokens 2" in msg and "num_nextn_predict_layers 0" in msg
        assert "set mtp_draft_tokens to 0" in msg


def test_mtp_drafts_hold_their_positions_in_every_cache_group():
    """A drafting decode role holds what its verify and draft chain write past a request's length
    (workers.scheduler.tokens_to_hold) in each group: 511 + 2 * 3 + 1 = 518 tokens need 3 swa pages (the
    prefix cache off; with it the cut state pages count too, and drafts add to them alike)."""
    base = merged(yaml_args("tiny_v4_mono.yaml"), model={"tiny": {"arch": "deepseek_v4"}, "max_model_len": 511},
                  decode={"num_pages": 2}, features={"prefix_caching": False})
    assert "decode.num_pages" not in _paths(base)  # 512 tokens: 2 pages of 256 window keys
    assert "swa 3" in _paths(merged(base, decode={"mtp_draft_tokens": 3}))["decode.num_pages"]
    cached = merged(base, features={"prefix_caching": True})
    errs = _paths(cached)["decode.num_pages"]  # 512 tokens: the live state page and 2 cut pages
    assert "csa_state 3" in errs and "swa" not in errs
    errs = _paths(merged(cached, decode={"mtp_draft_tokens": 3}))["decode.num_pages"]
    assert "csa_state 3" in errs and "swa 3" in errs


def test_what_v4_does_not_run_yet_is_refused_per_field():
    base = yaml_args("tiny_v4_mono.yaml")
    errs = _paths(merged(base, decode={"kv_cache_dtype": "fp8", "backend": "cuda", "device": "cuda", "num_gpus": 1,
                                       "dtype": "bfloat16", "num_pages": 1},
                         model={"tiny": {"arch": "deepseek_v4"}, "max_model_len": 600},
                         features={"mtp_topk_reuse": True, "two_batch_overlap": True}))
    assert "decode.kv_cache_dtype" not in errs  # fp8 caches run (the 584-byte V4 format)
    # The tiny model's attention (head_dim 32) does not have FlashMLA's shape: the cuda backend is refused.
    assert "needs head_dim 512" in errs["decode.backend"] and "head_dim 32" in errs["decode.backend"]
    assert "decode.device" not in errs  # a GPU is planned like the DSA models' (below)
    assert "swa 3" in errs["decode.num_pages"]  # 600 + 1 tokens: 3 pages of 256 window keys
    assert "select no top-k to reuse" in errs["features.mtp_topk_reuse"]
    assert "no top-k sharing" in " ".join(v for k, v in errs.items() if k == "features.two_batch_overlap")


def test_fp8_caches_are_accepted_and_both_roles_must_store_them_alike():
    base = yaml_args("tiny_v4_pd.yaml")
    fp8 = merged(base, prefill={"kv_cache_dtype": "fp8"}, decode={"kv_cache_dtype": "fp8"})
    result = check_args(fp8)
    assert result.ok, result.violations
    errs = _paths(merged(base, prefill={"kv_cache_dtype": "fp8"}, decode={"kv_cache_dtype": "auto"}))
    assert "prefill kv_cache_dtype 'fp8' vs decode 'auto'" in errs["decode.kv_cache_dtype"]
    # Under fp8 no group follows the model dtype (indexer keys in fp8 too): roles of different dtypes store
    # their pages alike, and the formats are what the rule compares.
    mixed = check_args(merged(fp8, decode={"dtype": "bfloat16"}))
    assert mixed.ok, mixed.violations


def test_a_v4_role_on_a_gpu_is_planned_and_refused_only_when_it_does_not_fit():
    base = merged(yaml_args("tiny_v4_mono.yaml"), decode={"device": "cuda", "num_gpus": 1, "dtype": "bfloat16",
                                                          "gpu_memory_gib": 80, "workspace_gib": 1})
    result = check_args(base)
    assert result.ok, result.violations
    from deployments.controller.memory import estimate_memory

    est = estimate_memory(result.app_cfg.decode, result.model_cfg)
    # One page id across every cache group: the pages-too-many error names how many fit.
    gib = (est.weights_bytes + est.workspace_bytes + 10 * est.bytes_per_page) / (1 << 30) / 0.9
    errs = _paths(merged(base, decode={"gpu_memory_gib": gib, "gpu_memory_utilization": 0.9}))
    assert "at most 10 pages" in errs["decode.num_pages"] or "at most 9 pages" in errs["decode.num_pages"]
    errs = _paths(merged(base, decode={"gpu_memory_gib": 1.5, "workspace_gib": 2}))
    assert "weights alone exceed the budget" in errs["decode.device"]


def test_v4_memory_plan_is_what_loading_allocates(tmp_path):
    """`estimate_memory` for a V4 role = the bytes a replica's rank holds once built from the role's
    `RankSpec` (as serving builds it): the cache groups' one buffer, and the model's parameters and
    buffers; with and without fp8 caches and the MTP layer (loaded only for a drafting role)."""
    from deployments.controller.memory import estimate_memory
    from models import fp8
    from models.tiny_v4 import make_tiny_v4
    from models.v4.cache_spec import cut_state_groups
    from workers.page_tables import GroupPagePools
    from workers.rank_build import build_rank
    from workers.v4_prefix import V4PrefixCache

    ckpt = make_tiny_v4(tmp_path / "v4")
    for kv, drafts in (("auto", 0), ("fp8", 2)):
        args = merged(yaml_args("tiny_v4_mono.yaml"), model={"path": str(ckpt), "tiny": None},
                      decode={"num_pages": 24, "kv_cache_dtype": kv, "mtp_draft_tokens": drafts})
        result = check_args(args)
        assert result.ok, result.violations
        role = result.app_cfg.decode
        est = estimate_memory(role, result.model_cfg)
        parts = build_rank(role.rank_spec(ckpt))
        assert (len(parts.model.mtp) > 0) == (drafts > 0)
        assert est.page_bytes == parts.cache.buffer.numel() * parts.cache.buffer.element_size()
        assert est.weights_bytes == fp8.weight_bytes(parts.model)
        # The prefix cache (on by default) allocates nothing of its own: a cut state is a page of its group's
        # num_pages, which the pools of a cached replica take from this buffer.
        assert result.app_cfg.features.prefix_caching
        pools = GroupPagePools(parts.cache, V4PrefixCache(b"", parts.cache.groups, cut_state_groups(result.model_cfg)))
        assert {g: p.num_pages for g, p in pools.pools.items()} == {g.name: 24 for g in parts.cache.groups}


def test_the_prefix_cache_pages_per_cut_are_counted():
    """With features.prefix_caching (the default) the CSA state groups hold a page per 256-token cut
    (workers.v4_prefix): 512 tokens fit 2 pages of window keys but need 3 csa_state pages."""
    base = merged(yaml_args("tiny_v4_pd.yaml"), model={"max_model_len": 512}, prefill={"num_pages": 2})
    errs = _paths(base)
    assert "csa_state 3" in errs["prefill.num_pages"] and "swa" not in errs["prefill.num_pages"]
    assert "prefill.num_pages" not in _paths(merged(base, features={"prefix_caching": False}))


def test_v4_on_the_cuda_backend_needs_flashmla_shapes_and_no_graphs():
    """backend 'cuda' takes a V4 checkpoint whose attention FlashMLA runs (head_dim 512, <= 128 heads); CUDA
    graphs are refused (the V4 runner is eager)."""
    base = merged(yaml_args("tiny_v4_mono.yaml"), decode={"backend": "cuda", "device": "cuda", "num_gpus": 1,
                                                          "dtype": "bfloat16", "gpu_memory_gib": 80, "workspace_gib": 1},
                  model={"tiny": {"arch": "deepseek_v4", "attention": "serving"}})
    result = check_args(base)
    assert result.ok, result.violations
    errs = _paths(merged(base, decode={"cuda_graphs": True}))
    assert "not built for DeepSeek-V4" in errs["decode.cuda_graphs"]
    errs = _paths(merged(base, decode={"prefill_graph_max_tokens": 256}))
    assert "not built for DeepSeek-V4" in errs["decode.prefill_graph_max_tokens"]
    from attention.cuda.v4_attention import check_v4_dims

    check_v4_dims(512, 128)
    with pytest.raises(ValueError, match="at most 128 attention heads"):
        check_v4_dims(512, 256)
