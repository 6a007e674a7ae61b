"""Typed app args: defaults, field errors with their paths, the model source and the tiny-model cache."""

from __future__ import annotations

import pydantic
import pytest

from deployments.app_config import AppConfig, ModelSource, RoleConfig, TinyModelSpec
from deployments.controller import violations_from_pydantic
from models.config import config_from_dict, load_config
from tests.deployments.app_fixtures import YAMLS, yaml_args


def errors(args: dict) -> dict[str, str]:
    with pytest.raises(pydantic.ValidationError) as exc:
        AppConfig.model_validate(args)
    return {v.path: v.message for v in violations_from_pydantic(exc.value)}


TINY = {"model": {"tiny": {"arch": "deepseek_v32"}}}


def test_defaults_are_a_cpu_demo():
    cfg = AppConfig.model_validate(TINY)
    for pool in (cfg.prefill, cfg.decode):
        assert (pool.backend, pool.device, pool.dtype, pool.kv_cache_dtype) == ("reference", "cpu", "float32", "auto")
        assert (pool.tensor_parallel_size, pool.num_gpus, pool.page_size, pool.mtp_draft_tokens) == (1, 0.0, 64, 0)
        assert pool.num_replicas is None and pool.autoscaling is None
    assert cfg.router.policy == "cache_aware" and cfg.features.prefix_caching
    assert cfg.transfer.warmup_at_start and cfg.transfer.deadline_s > 0
    assert (cfg.features.two_batch_overlap, cfg.features.mtp_topk_reuse, cfg.features.draft_topk) == (False, False, 1)
    assert cfg.model_name == "tiny-deepseek_v32"
    assert AppConfig.model_validate({"model": {"path": "/models/DeepSeek-V3.2"}}).model_name == "DeepSeek-V3.2"


@pytest.mark.parametrize("name", YAMLS)
def test_shipped_args_parse(name):
    AppConfig.model_validate(yaml_args(name))


def test_typos_and_bad_values_name_their_paths():
    errs = errors({
        "model": {"tiny": {"arch": "llama"}},
        "decode": {"num_page": 4, "kv_cache_dtype": "int8", "mtp_draft_tokens": 4, "num_gpus": -1},
        "prefill": {"backend": "triton", "tensor_parallel_size": 0},
        "router": {"policy": "random"},
        "features": {"draft_topk": 0, "two_batch_overlap": "maybe"},
        "transfer": {"deadline_s": 0},
        "extra_section": {},
    })
    assert set(errs) == {
        "model.tiny.arch", "decode.num_page", "decode.kv_cache_dtype", "decode.mtp_draft_tokens", "decode.num_gpus",
        "prefill.backend", "prefill.tensor_parallel_size", "router.policy", "features.draft_topk",
        "features.two_batch_overlap", "transfer.deadline_s", "extra_section",
    }
    assert errs["decode.num_page"] == "unknown field (a typo?)"
    assert "'auto' or 'fp8'" in errs["decode.kv_cache_dtype"] and "'int8'" in errs["decode.kv_cache_dtype"]
    assert "less than or equal to 3" in errs["decode.mtp_draft_tokens"]


def test_model_source_is_exactly_one():
    assert "exactly one of model.path" in errors({"model": {}})["model"]
    assert "exactly one of model.path" in errors({"model": {"path": "/x", "tiny": {"arch": "glm_moe_dsa"}}})["model"]
    assert "cannot be given with model.tiny" in errors({"model": {"tiny": {"arch": "glm_moe_dsa"}, "config": {}}})["model"]
    assert "model" in errors({})


def test_replicas_or_autoscaling():
    errs = errors({**TINY, "decode": {"num_replicas": 2, "autoscaling": {"min_replicas": 1, "max_replicas": 2}}})
    assert errs["decode"] == "give num_replicas or autoscaling, not both"
    errs = errors({**TINY, "prefill": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}})
    assert errs["prefill.autoscaling"] == "min_replicas (3) must be <= max_replicas (2)"
    assert "greater than or equal to 1" in errors({**TINY, "prefill": {"autoscaling": {"min_replicas": 0}}})[
        "prefill.autoscaling.min_replicas"]


def test_gil_switch_interval_bounds():
    assert AppConfig.model_validate({**TINY, "decode": {"gil_switch_interval_ms": 1.5}}).decode.gil_switch_interval_ms == 1.5
    assert "greater than 0" in errors({**TINY, "decode": {"gil_switch_interval_ms": 0}})["decode.gil_switch_interval_ms"]
    assert "less than or equal to 100" in errors({**TINY, "prefill": {"gil_switch_interval_ms": 500}})[
        "prefill.gil_switch_interval_ms"]


def test_engine_process_runs_one_rank():
    from deployments.controller import check_args

    ok = check_args({**TINY, "decode": {"engine_process": True}, "prefill": {"engine_process": True}})
    assert ok.ok and ok.app_cfg.decode.engine_process, [str(v) for v in ok.violations]
    bad = check_args({**TINY, "decode": {"engine_process": True, "tensor_parallel_size": 2}})
    assert [v.path for v in bad.violations if "engine process" in v.message] == ["decode.engine_process"]


def test_engine_process_default_follows_backend_and_ranks():
    """Unset: on for the cuda backend at one rank (measured there), off for the reference backend and for
    tensor parallel (where an explicit true is refused, the default is simply off: no violation)."""
    from deployments.app_config import RoleConfig

    assert RoleConfig().engine_process is None
    assert not RoleConfig(backend="reference").runs_engine_process
    assert RoleConfig(backend="cuda", device="cuda").runs_engine_process
    assert not RoleConfig(backend="cuda", device="cuda", tensor_parallel_size=2).runs_engine_process
    assert not RoleConfig(backend="cuda", device="cuda", engine_process=False).runs_engine_process
    assert RoleConfig(backend="reference", engine_process=True).runs_engine_process


def test_configs_are_frozen():
    cfg = AppConfig.model_validate(TINY)
    with pytest.raises(pydantic.ValidationError):
        cfg.decode.num_pages = 3  # type: ignore[misc]


def test_pool_helpers():
    p = RoleConfig(mtp_draft_tokens=2, max_batch_size=8)
    assert p.has_mtp and p.ongoing_requests_cap == 16
    assert RoleConfig(max_ongoing_requests=5).ongoing_requests_cap == 5
    assert AppConfig.model_validate(TINY).for_role("decode") is not None
    with pytest.raises(ValueError, match="role"):
        AppConfig.model_validate(TINY).for_role("router")


def test_tiny_model_made_once_into_the_cache_and_matches_its_spec(tmp_path):
    """The config ``dsa-pd check`` derives from a tiny spec is the one the made checkpoint has."""
    src = ModelSource(tiny=TinyModelSpec(arch="glm_moe_dsa", seed=3), cache_dir=str(tmp_path))
    assert src.checkpoint_dir() == tmp_path / "tiny-glm_moe_dsa-s3"
    assert not src.checkpoint_dir().exists()  # not made unless asked
    out = src.checkpoint_dir(make=True)
    assert out == tmp_path / "tiny-glm_moe_dsa-s3" and (out / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no temporary directory left behind
    assert load_config(out) == config_from_dict(src.tiny.config_dict())
    mtime = (out / "config.json").stat().st_mtime_ns
    assert src.checkpoint_dir(make=True) == out and (out / "config.json").stat().st_mtime_ns == mtime


def test_tiny_fp8_spec_declares_block_quantization():
    cfg = config_from_dict(TinyModelSpec(arch="deepseek_v32", fp8=True).config_dict())
    assert cfg.weight_block_size == (128, 128)
    assert TinyModelSpec(arch="deepseek_v32", fp8=True).dir_name == "tiny-deepseek_v32-s0-fp8"
