"""The cuda backend's kernel dims are checked before placement."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from deployments.app_config import TinyModelSpec
from deployments.controller import check_args

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _gpu_args() -> dict:
    return copy.deepcopy(yaml.safe_load((CONFIGS / "tiny_pd_gpu.yaml").read_text())["applications"][0]["args"])


def test_tiny_gpu_config_uses_serving_attention_dims():
    args = _gpu_args()
    assert args["model"]["tiny"]["attention"] == "serving"
    assert not check_args(args).violations
    raw = TinyModelSpec(**args["model"]["tiny"]).config_dict()
    assert (raw["kv_lora_rank"], raw["qk_rope_head_dim"], raw["index_head_dim"]) == (512, 64, 128)


def test_cuda_backend_refuses_tiny_attention_dims_with_the_field_path():
    args = _gpu_args()
    args["model"]["tiny"]["attention"] = "tiny"
    violations = check_args(args).violations
    paths = {v.path for v in violations}
    assert {"prefill.backend", "decode.backend"} <= paths
    assert any("kv_lora_rank = 512" in v.message for v in violations)


def test_cuda_backend_refuses_unquantized_cache():
    args = _gpu_args()
    args["decode"]["kv_cache_dtype"] = "auto"
    messages = [v.message for v in check_args(args).violations if v.path == "decode.backend"]
    assert messages and "fp8" in messages[0]
