"""Model configuration: a checked, typed view of a checkpoint's ``config.json``.

``load_config`` parses ``config.json`` through transformers' own config class
(so defaults and derived fields agree with the transformers reference model),
then re-reads the raw JSON for the fields that some transformers versions
rewrite, and validates everything the serving code relies on.  Every failure
is a ``ConfigError`` whose message names the field and the offending value.

The layer top-k plan (which layers run their own DSA indexer and which reuse
an earlier layer's top-k, a GLM-5 feature) is computed here once, by
``compute_topk_plan``, and carried on the config.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "ConfigError",
    "TopkPlan",
    "ModelConfig",
    "SUPPORTED_ARCHS",
    "compute_topk_plan",
    "load_config",
    "parse_quantization_config",
    "config_from_dict",
]

Arch = Literal["deepseek_v32", "glm_moe_dsa"]
SUPPORTED_ARCHS: tuple[str, ...] = ("deepseek_v32", "glm_moe_dsa")

# The only weight quantization we read: fp8 e4m3 with per-block float32 scales.
_FP8_FMT = "e4m3"


class ConfigError(ValueError):
    """A checkpoint configuration we cannot serve; the message names the field and value."""


# --------------------------------------------------------------------------- top-k plan


@dataclass(frozen=True)
class TopkPlan:
    """Which layers compute DSA top-k indices and which reuse them.

    Layers are indexed over the main stack followed by the MTP (next-n)
    layers: ``0 .. num_layers + num_mtp_layers - 1``.

    Attributes:
        computes: per layer, True when the layer runs its own indexer.
        source: per layer, the layer whose top-k it attends with (itself when
            it computes; otherwise the nearest computing layer before it).
        num_mtp_layers: how many trailing entries are MTP layers (they always
            compute: each owns an indexer).
    """

    computes: tuple[bool, ...]
    source: tuple[int, ...]
    num_mtp_layers: int = 0

    @property
    def num_layers(self) -> int:
        """Number of main (non-MTP) layers."""
        return len(self.computes) - self.num_mtp_layers

    @property
    def has_sharing(self) -> bool:
        """True when at least one layer reuses another layer's top-k."""
        return not all(self.computes)

    @property
    def computing_layers(self) -> tuple[int, ...]:
        """Indices of the layers that own an indexer, ascending."""
        return tuple(i for i, c in enumerate(self.computes) if c)


_PATTERN_CHARS = {"F": True, "S": False}
_INDEXER_TYPES = {"full": True, "shared": False}


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{name} must be >= 1, got {value!r}")
    return value


def compute_topk_plan(
    num_layers: int,
    indexer_types: Sequence[str] | None = None,
    index_topk_pattern: str | Sequence[str] | None = None,
    index_topk_freq: int | None = None,
    index_skip_topk_offset: int | None = None,
    mtp_layers: int = 0,
) -> TopkPlan:
    """Decide, per layer, whether it computes its own top-k or reuses one.

    Priority: ``indexer_types`` ("full"/"shared" per layer) over
    ``index_topk_pattern`` ('F'/'S' per layer, a string or a list) over the
    (``index_topk_freq``, ``index_skip_topk_offset``) schedule, under which
    layer ``l`` is shared iff ``max(l - offset + 1, 0) % freq != 0`` (without
    an offset: iff ``max(l - 1, 0) % freq != 0``).  ``freq`` None or 1 means
    every layer computes.  The ``mtp_layers`` MTP layers that follow the main
    stack always compute.

    Raises:
        ConfigError: non-positive freq or offset, a per-layer list whose
            length is not ``num_layers``, an unknown pattern character or
            indexer type, or a shared layer with no computing layer before it.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
        raise ConfigError(f"num_hidden_layers must be a non-negative integer, got {num_layers!r}")
    if isinstance(mtp_layers, bool) or not isinstance(mtp_layers, int) or mtp_layers < 0:
        raise ConfigError(f"num_nextn_predict_layers must be a non-negative integer, got {mtp_layers!r}")

    if indexer_types is not None:
        types = list(indexer_types)
        if len(types) != num_layers:
            raise ConfigError(
                f"indexer_types has {len(types)} entries but num_hidden_layers is {num_layers}: {types!r}"
            )
        computes = []
        for i, t in enumerate(types):
            if t not in _INDEXER_TYPES:
                raise ConfigError(
                    f"indexer_types[{i}] is {t!r}; expected one of {sorted(_INDEXER_TYPES)}"
                )
            computes.append(_INDEXER_TYPES[t])
    elif index_topk_pattern is not None:
        chars = list(index_topk_pattern)
        if len(chars) != num_layers:
            raise ConfigError(
                f"index_topk_pattern has length {len(chars)} but num_hidden_layers is {num_layers}: "
                f"{index_topk_pattern!r}"
            )
        computes = []
        for i, c in enumerate(chars):
            if c not in _PATTERN_CHARS:
                raise ConfigError(
                    f"index_topk_pattern[{i}] is {c!r}; expected 'F' (full) or 'S' (shared)"
                )
            computes.append(_PATTERN_CHARS[c])
    else:
        freq = 1 if index_topk_freq is None else _check_positive_int("index_topk_freq", index_topk_freq)
        # Absent offset behaves as offset 2 (max(l - 1, 0)), which is also transformers' default.
        offset = 2 if index_skip_topk_offset is None else _check_positive_int(
            "index_skip_topk_offset", index_skip_topk_offset
        )
        computes = [max(l - offset + 1, 0) % freq == 0 for l in range(num_layers)]

    source: list[int] = []
    last = -1
    for l, c in enumerate(computes):
        if c:
            last = l
        elif last < 0:
            # A shared layer with nothing before it would read an uninitialised top-k.
            raise ConfigError(
                f"layer {l} is 'shared' but no layer before it computes top-k "
                f"(indexer plan {['full' if x else 'shared' for x in computes]!r})"
            )
        source.append(last)

    computes += [True] * mtp_layers
    source += list(range(num_layers, num_layers + mtp_layers))
    return TopkPlan(computes=tuple(computes), source=tuple(source), num_mtp_layers=mtp_layers)


# --------------------------------------------------------------------------- model config


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code reads from a checkpoint's config, checked.

    Dimensions are in elements.  Layer indices ``0 .. num_hidden_layers - 1``
    are the main stack; ``num_hidden_layers .. num_layers_with_mtp - 1`` the
    MTP (next-n) layers, which are MoE layers with their own indexer.
    ``hf_config`` is the transformers config object, for transformers' rope
    init functions, with ``head_dim`` / ``qk_rope_head_dim`` set to the raw
    ``qk_rope_head_dim`` and (GLM) ``indexer_types`` set from ``topk_plan``;
    it does not take part in equality or hashing.
    """

    arch: Arch
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    hidden_act: str
    attention_bias: bool
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    mlp_layer_types: tuple[str, ...]
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    indexer_rope_interleave: bool
    weight_block_size: tuple[int, int] | None
    topk_plan: TopkPlan
    rope_parameters: dict = field(default_factory=dict, compare=False, hash=False)
    hf_config: Any = field(default=None, compare=False, hash=False, repr=False)
    identity: str = field(default="", compare=False, hash=False, repr=False)
    """`config_identity` of the config.json this was built from ("" if built by hand)."""

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of MLA: nope part + rope part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Per-token MLA latent width: normed latent + rope key (576 for DeepSeek-V3.2)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_layers_with_mtp(self) -> int:
        """Main layers plus MTP layers."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    @property
    def is_fp8(self) -> bool:
        """True when the checkpoint stores block-quantized fp8 weights."""
        return self.weight_block_size is not None

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 10000.0))

    @property
    def rope_type(self) -> str:
        return str(self.rope_parameters.get("rope_type", "default"))


def _raw_int(raw: dict, name: str, default: int | None) -> int | None:
    value = raw.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    return value


def parse_quantization_config(raw: dict) -> tuple[int, int] | None:
    """fp8 ``weight_block_size`` from a raw config dict's ``quantization_config``, or None if absent."""
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(
            f"quantization_config.quant_method {method!r} is not supported; only 'fp8' "
            "(block-quantized e4m3 weights with float32 scale_inv) is"
        )
    fmt = q.get("fmt", _FP8_FMT)
    if fmt != _FP8_FMT:
        raise ConfigError(f"quantization_config.fmt {fmt!r} is not supported; only {_FP8_FMT!r} is")
    block = q.get("weight_block_size")
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ConfigError(
            f"quantization_config.weight_block_size must be two positive integers, got {block!r}"
        )
    return (int(block[0]), int(block[1]))


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise ConfigError(f"eos_token_id must be an integer or a list of integers, got {value!r}")


def _check_mlp_layer_types(types: Sequence[str], num_layers: int) -> None:
    if len(types) != num_layers:
        raise ConfigError(
            f"mlp_layer_types has {len(types)} entries but num_hidden_layers is {num_layers}: {list(types)!r}"
        )
    for i, t in enumerate(types):
        if t not in ("dense", "sparse"):
            raise ConfigError(f"mlp_layer_types[{i}] is {t!r}; expected 'dense' or 'sparse'")


def _build_hf_config(raw: dict):
    from transformers import DeepseekV32Config, GlmMoeDsaConfig

    cls = {"deepseek_v32": DeepseekV32Config, "glm_moe_dsa": GlmMoeDsaConfig}[raw["model_type"]]
    kwargs = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except Exception as e:  # transformers' strict validation; its message names the field
        raise ConfigError(f"{cls.__name__} rejected config.json: {e}") from e


def config_identity(raw: dict) -> str:
    """``<model_type>:<16 hex of sha256 of the canonical config.json>``: which checkpoint config a
    replica serves. Prefill and decode must agree on it: the transfer handshake compares it
    (`workers.kv_link.compat_info`), and the controller before placement."""
    digest = hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:16]
    return f"{raw.get('model_type', '?')}:{digest}"


def config_from_dict(raw: dict) -> ModelConfig:
    """Build a ``ModelConfig`` from the parsed contents of a ``config.json``.

    Same semantics as ``load_config``; useful for tests and for configs that
    travel over the wire.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_ARCHS:
        raise ConfigError(
            f"model_type {model_type!r} is not supported; expected one of {list(SUPPORTED_ARCHS)}"
        )
    # Checked before transformers so that the message names our field whatever
    # its version validates (it reports an odd qk_rope_head_dim as `head_dim`).
    if raw.get("mlp_layer_types") is not None and isinstance(raw.get("num_hidden_layers"), int):
        _check_mlp_layer_types(raw["mlp_layer_types"], raw["num_hidden_layers"])
    raw_qk_rope = _raw_int(raw, "qk_rope_head_dim", None)
    if raw_qk_rope is not None and (raw_qk_rope <= 0 or raw_qk_rope % 2):
        raise ConfigError(f"qk_rope_head_dim must be a positive even number, got {raw_qk_rope!r}")
    mtp = _raw_int(raw, "num_nextn_predict_layers", 0)
    if mtp is None or mtp < 0:
        raise ConfigError(f"num_nextn_predict_layers must be >= 0, got {mtp!r}")

    hf = _build_hf_config(raw)

    # Raw values win over what transformers derived: some versions rewrite
    # qk_rope_head_dim from head_dim, or drop the top-k sharing fields.
    qk_rope = hf.qk_rope_head_dim if raw_qk_rope is None else raw_qk_rope
    # transformers' rope init reads head_dim as the rotary width.
    hf.qk_rope_head_dim = qk_rope
    hf.head_dim = qk_rope
    hf.qk_head_dim = hf.qk_nope_head_dim + qk_rope

    num_layers = hf.num_hidden_layers
    plan = compute_topk_plan(
        num_layers,
        indexer_types=raw.get("indexer_types"),
        index_topk_pattern=raw.get("index_topk_pattern"),
        index_topk_freq=raw.get("index_topk_freq"),
        index_skip_topk_offset=raw.get("index_skip_topk_offset"),
        mtp_layers=mtp,
    )
    # Keep hf_config consistent with what we serve, for anyone building from it.
    hf.num_nextn_predict_layers = mtp
    if model_type == "glm_moe_dsa":
        hf.indexer_types = ["full" if c else "shared" for c in plan.computes[:num_layers]]

    if hf.index_head_dim < qk_rope:
        raise ConfigError(
            f"index_head_dim ({hf.index_head_dim}) must be >= qk_rope_head_dim ({qk_rope}): "
            "the indexer applies RoPE to its first qk_rope_head_dim channels"
        )
    if hf.q_lora_rank is None or hf.q_lora_rank <= 0:
        # The DSA indexer projects its queries from the q LoRA latent.
        raise ConfigError(f"q_lora_rank must be a positive integer for DSA models, got {hf.q_lora_rank!r}")
    mlp_types = tuple(hf.mlp_layer_types)
    _check_mlp_layer_types(mlp_types, num_layers)
    if hf.n_group <= 0 or hf.n_routed_experts % hf.n_group:
        raise ConfigError(
            f"n_group {hf.n_group!r} must be positive and divide n_routed_experts ({hf.n_routed_experts})"
        )
    if not 1 <= hf.topk_group <= hf.n_group:
        raise ConfigError(f"topk_group {hf.topk_group!r} must be in [1, n_group={hf.n_group}]")
    if not 1 <= hf.num_experts_per_tok <= hf.n_routed_experts:
        raise ConfigError(
            f"num_experts_per_tok {hf.num_experts_per_tok!r} must be in [1, n_routed_experts={hf.n_routed_experts}]"
        )
    if hf.index_topk <= 0:
        raise ConfigError(f"index_topk must be >= 1, got {hf.index_topk!r}")

    rope = dict(hf.rope_parameters or {})
    return ModelConfig(
        arch=model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        moe_intermediate_size=hf.moe_intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hf.num_attention_heads,
        q_lora_rank=hf.q_lora_rank,
        kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=qk_rope,
        v_head_dim=hf.v_head_dim,
        n_routed_experts=hf.n_routed_experts,
        n_shared_experts=hf.n_shared_experts,
        num_experts_per_tok=hf.num_experts_per_tok,
        n_group=hf.n_group,
        topk_group=hf.topk_group,
        norm_topk_prob=bool(hf.norm_topk_prob),
        routed_scaling_factor=float(hf.routed_scaling_factor),
        rms_norm_eps=float(hf.rms_norm_eps),
        hidden_act=hf.hidden_act,
        attention_bias=bool(hf.attention_bias),
        index_n_heads=hf.index_n_heads,
        index_head_dim=hf.index_head_dim,
        index_topk=hf.index_topk,
        mlp_layer_types=mlp_types,
        num_nextn_predict_layers=mtp,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        max_position_embeddings=hf.max_position_embeddings,
        bos_token_id=hf.bos_token_id,
        eos_token_ids=_eos_ids(hf.eos_token_id),
        # DeepSeek-V3.2's indexer rotates half-split; GLM-5's interleaved.
        indexer_rope_interleave=(model_type == "glm_moe_dsa"),
        weight_block_size=parse_quantization_config(raw),
        topk_plan=plan,
        rope_parameters=rope,
        hf_config=hf,
        identity=config_identity(raw),
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read ``model_dir/config.json`` (model_type deepseek_v32 or glm_moe_dsa).

    Raises:
        ConfigError: missing or unreadable config.json, unknown model_type,
            unsupported quantization, or any inconsistent field.
    """
    path = Path(model_dir) / "config.json"
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"config.json not readable at {str(path)!r}: {e}") from e
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"config.json at {str(path)!r} is not valid JSON: {e}") from e
    return config_from_dict(raw)

