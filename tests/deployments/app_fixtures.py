"""Shared helpers of the deployment tests: serve-config args and model configs (imported, not a conftest)."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import yaml

from deployments.app_config import SERVING_ATTENTION_DIMS
from models.config import config_from_dict
from models.tiny import tiny_config_kwargs

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
YAMLS = ("tiny_pd.yaml", "tiny_pd_gpu.yaml", "tiny_mono.yaml", "tiny_mono_gpu.yaml", "dsv32_pd.yaml", "glm5_pd.yaml",
         "small_pd.yaml", "tiny_v4_pd.yaml", "tiny_v4_mono.yaml")


def yaml_args(name: str) -> dict:
    """The ``args`` of the (single) application in ``configs/<name>``."""
    doc = yaml.safe_load((CONFIGS / name).read_text())
    return copy.deepcopy(doc["applications"][0]["args"])


def merged(base: dict, **sections) -> dict:
    """``base`` with ``sections`` merged in one level deep (``decode={"num_pages": 3}`` keeps decode's other keys)."""
    out = copy.deepcopy(base)
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def tiny_raw(arch: str = "deepseek_v32", **overrides) -> dict:
    """A tiny model's config.json contents, with ``overrides``."""
    return dict(tiny_config_kwargs(arch, **overrides), model_type=arch)


def tiny_model(arch: str = "deepseek_v32", **overrides):
    if arch == "deepseek_v4":
        from models.v4.config import v4_config_from_dict

        return v4_config_from_dict(tiny_raw(arch, **overrides))
    return config_from_dict(tiny_raw(arch, **overrides))


def gpu_model(arch: str = "deepseek_v32", **overrides):
    """A tiny model with the serving attention dims (``attention: serving``),
    the only ones the cuda backend's kernels run."""
    return tiny_model(arch, **{**SERVING_ATTENTION_DIMS, **overrides})


def shipped_model(name: str):
    """The ``ModelConfig`` ``configs/<name>`` serves: a tiny spec's (with the serving attention dims
    where it asks for them, as the cuda configs do), or the inline config.json copy."""
    model = yaml_args(name)["model"]
    tiny = model.get("tiny")
    if tiny is None and "config" not in model:  # a checkpoint shipped in the checkout
        from deployments.app_config import AppConfig
        from models.config import load_config

        return load_config(AppConfig.model_validate(yaml_args(name)).model.checkpoint_dir())
    if tiny is None:
        return real_model(name)
    return gpu_model(tiny["arch"]) if tiny.get("attention") == "serving" else tiny_model(tiny["arch"])


@functools.cache
def real_model(name: str):
    """The ``ModelConfig`` of ``configs/<name>``'s inline config.json copy (cached: parsing is slowish)."""
    return config_from_dict(yaml_args(name)["model"]["config"])
