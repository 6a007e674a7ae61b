"""The controller on DeepSeek-V4 configs: what TBO, top-k reuse and MTP mean for V4, and what its engine
runs today (deployments/controller/v4_rules.py)."""

from __future__ import annotations

from deployments.controller import check_args
from models.v4.config import V4Config
from tests.deployments.app_fixtures import merged, yaml_args


def _paths(args) -> dict[str, str]:
    return {v.path: v.message for v in check_args(args).violations}


def test_shipped_v4_configs_pass_with_a_v4_model_config():
    for name in ("tiny_v4_pd.yaml", "tiny_v4_mono.yaml"):
        result = check_args(yaml_args(name))
        assert result.ok, result.violations
        assert isinstance(result.model_cfg, V4Config)


def test_mtp_is_refused_naming_the_field():
    base = yaml_args("tiny_v4_pd.yaml")
    errs = _paths(merged(base, prefill={"mtp_draft_tokens": 2}, decode={"mtp_draft_tokens": 2}))
    for role in ("prefill", "decode"):
        msg = errs[f"{role}.mtp_draft_tokens"]
        assert "mtp_draft_tokens 2" in msg and "MTP layer is not built" in msg and "set mtp_draft_tokens to 0" in msg


def test_what_v4_does_not_run_yet_is_refused_per_field():
    base = yaml_args("tiny_v4_mono.yaml")
    errs = _paths(merged(base, decode={"kv_cache_dtype": "fp8", "backend": "cuda", "device": "cuda", "num_gpus": 1,
                                       "dtype": "bfloat16", "num_pages": 1},
                         model={"tiny": {"arch": "deepseek_v4"}, "max_model_len": 600},
                         features={"mtp_topk_reuse": True, "two_batch_overlap": True}))
    assert "decode.kv_cache_dtype" not in errs  # fp8 caches run (the 584-byte V4 format)
    assert "reference backend only" in errs["decode.backend"]
    assert "memory plan" in errs["decode.device"]
    assert "swa 3" in errs["decode.num_pages"]  # 600 + 1 tokens: 3 pages of 256 window keys
    assert "no MTP drafts" in errs["features.mtp_topk_reuse"]
    assert "no top-k sharing" in " ".join(v for k, v in errs.items() if k == "features.two_batch_overlap")


def test_fp8_caches_are_accepted_and_both_roles_must_store_them_alike():
    base = yaml_args("tiny_v4_pd.yaml")
    fp8 = merged(base, prefill={"kv_cache_dtype": "fp8"}, decode={"kv_cache_dtype": "fp8"})
    result = check_args(fp8)
    assert result.ok, result.violations
    errs = _paths(merged(base, prefill={"kv_cache_dtype": "fp8"}, decode={"kv_cache_dtype": "auto"}))
    assert "prefill kv_cache_dtype 'fp8' vs decode 'auto'" in errs["decode.kv_cache_dtype"]
    # fp8 keeps V4's indexer keys in the model dtype: the dtypes must agree too.
    errs = _paths(merged(fp8, decode={"dtype": "bfloat16"}))
    assert "csa_index float32x" in errs["decode.dtype"] and "indexer keys in the model dtype" in errs["decode.dtype"]


def test_the_prefix_cache_pages_per_cut_are_counted():
    """With features.prefix_caching (the default) the CSA state groups hold a page per 256-token cut
    (workers.v4_prefix): 512 tokens fit 2 pages of window keys but need 3 csa_state pages."""
    base = merged(yaml_args("tiny_v4_pd.yaml"), model={"max_model_len": 512}, prefill={"num_pages": 2})
    errs = _paths(base)
    assert "csa_state 3" in errs["prefill.num_pages"] and "swa" not in errs["prefill.num_pages"]
    assert "prefill.num_pages" not in _paths(merged(base, features={"prefix_caching": False}))
