"""Model registry: ``model_type`` -> how to parse, build and load that architecture.

One ``ArchSpec`` per architecture family, looked up by the ``model_type`` of a
checkpoint's ``config.json``; callers dispatch through it instead of testing
the type themselves::

    spec = arch_spec(raw["model_type"])
    cfg = spec.parse_config(raw)
    model = spec.load_model(model_dir, dtype=torch.float32)

``deepseek_v32`` and ``glm_moe_dsa`` share the DSA implementation
(``models.model.DsaForCausalLM``, ``models.config.ModelConfig``);
``deepseek_v4`` lives in ``models/v4/``; the engine (``workers/``) builds
an architecture with ``cache_groups`` through its grouped path
(``workers.rank_build``: ``GroupedPagedCache``, ``V4ModelRunner``; reference
backend only) and the DSA family through ``attention.cache.CacheSpec``.
Implementations are imported on first use, so importing the registry is cheap.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.config import ConfigError

__all__ = ["ArchSpec", "REGISTRY", "arch_spec", "read_config_json", "load_any_config", "load_any_model",
           "count_parameters"]


@dataclass(frozen=True)
class ArchSpec:
    """How one architecture family plugs in.

    parse_config:  raw config.json dict -> the family's checked config (raises ``ConfigError``)
    build_model:   (config, dtype) -> the model with uninitialised weights (call under
                   ``torch.device("meta")`` to allocate nothing)
    load_model:    (model_dir, dtype=, device=) -> the model with the checkpoint's weights
    module_name:   (checkpoint tensor name, config) -> parameter name, or None if not held
    cache_groups:  config -> the cache groups its attention layers need
                   (``attention.cache_groups.CacheGroup``), or None where the family
                   uses the one-page-size ``attention.cache.CacheSpec``
    """

    model_type: str
    parse_config: Callable[[dict], Any]
    build_model: Callable[[Any, torch.dtype], torch.nn.Module]
    load_model: Callable[..., torch.nn.Module]
    module_name: Callable[[str, Any], str | None]
    cache_groups: Callable[[Any], tuple] | None = None


def _dsa_parse(raw: dict):
    from models.config import config_from_dict

    return config_from_dict(raw)


def _dsa_build(cfg, dtype: torch.dtype):
    from models.model import DsaForCausalLM

    return DsaForCausalLM(cfg, dtype=dtype)


def _dsa_load(model_dir, dtype: torch.dtype = torch.float32, device: str = "cpu", **kw):
    from models.loader import load_model

    return load_model(model_dir, dtype=dtype, device=device, **kw)


def _dsa_name(ckpt_name: str, cfg):
    from models.loader import module_name

    return module_name(ckpt_name, cfg)


def _v4_parse(raw: dict):
    from models.v4.config import v4_config_from_dict

    return v4_config_from_dict(raw)


def _v4_build(cfg, dtype: torch.dtype):
    from models.v4.model import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM(cfg, dtype=dtype)


def _v4_load(model_dir, dtype: torch.dtype = torch.float32, device: str = "cpu", **kw):
    from models.v4.loader import load_v4_model

    return load_v4_model(model_dir, dtype=dtype, device=device, **kw)


def _v4_name(ckpt_name: str, cfg):
    from models.v4.loader import v4_module_name

    return v4_module_name(ckpt_name, cfg)


def _v4_groups(cfg):
    from models.v4.cache_spec import v4_cache_groups

    return v4_cache_groups(cfg)


_DSA = dict(parse_config=_dsa_parse, build_model=_dsa_build, load_model=_dsa_load, module_name=_dsa_name)
REGISTRY: dict[str, ArchSpec] = {
    "deepseek_v32": ArchSpec("deepseek_v32", **_DSA),
    "glm_moe_dsa": ArchSpec("glm_moe_dsa", **_DSA),
    "deepseek_v4": ArchSpec("deepseek_v4", _v4_parse, _v4_build, _v4_load, _v4_name, _v4_groups),
}


def arch_spec(model_type: Any) -> ArchSpec:
    """The spec of ``model_type``; ``ConfigError`` naming the known types otherwise."""
    try:
        return REGISTRY[model_type]
    except (KeyError, TypeError):
        raise ConfigError(f"model_type {model_type!r} is not supported; expected one of {sorted(REGISTRY)}") from None


def read_config_json(model_dir: str | Path) -> dict:
    """The raw ``config.json`` of a checkpoint directory; ``ConfigError`` if unreadable."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"config.json not readable at {str(path)!r}: {e}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"config.json at {str(path)!r} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"config.json at {str(path)!r} must be a JSON object")
    return raw


def load_any_config(model_dir: str | Path):
    """The checked config of whatever registered architecture ``model_dir`` holds."""
    raw = read_config_json(model_dir)
    return arch_spec(raw.get("model_type")).parse_config(raw)


def load_any_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", **kw):
    """The model of whatever registered architecture ``model_dir`` holds, weights loaded."""
    raw = read_config_json(model_dir)
    return arch_spec(raw.get("model_type")).load_model(model_dir, dtype=dtype, device=device, **kw)


def count_parameters(cfg) -> int:
    """Parameters the family's model holds for ``cfg`` (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = arch_spec(cfg.arch).build_model(cfg, torch.bfloat16)
    return sum(p.numel() for p in model.parameters())
