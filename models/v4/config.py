"""DeepSeek-V4 configuration: a checked, typed view of a ``deepseek_v4`` ``config.json``.

Parsed through transformers' ``DeepseekV4Config`` (so legacy fields such as
``compress_ratios`` / ``num_hash_layers`` / ``qk_rope_head_dim`` fold in exactly
as the reference model folds them), then checked for everything the serving
code relies on. Every failure is a ``ConfigError`` naming the field and value.

Per layer ``l`` (``0 .. num_hidden_layers - 1``):

* ``layer_types[l]``: ``sliding_attention`` (window only, ratio 0),
  ``compressed_sparse_attention`` (CSA: window + indexer top-k over entries
  compressed ``compress_rates[CSA]`` : 1, with overlapping windows) or
  ``heavily_compressed_attention`` (HCA: window + every causal entry compressed
  ``compress_rates[HCA]`` : 1); ``compress_ratio(l)`` is 0 / m / m'.
* ``mlp_layer_types[l]``: ``hash_moe`` (experts from a frozen token-id table)
  or ``moe`` (learned top-k with a bias).

The MTP (next-n) layers are layers ``num_hidden_layers + d`` (``d <
num_nextn_predict_layers``): sliding-window attention (ratio 0) and a learned
``moe`` FFN (`layer_type`, `mlp_layer_type`; ``models.v4.mtp``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from models.config import ConfigError, config_identity, parse_quantization_config

__all__ = ["V4Config", "v4_config_from_dict", "SLIDING", "CSA", "HCA"]

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_LAYER_TYPES = (SLIDING, CSA, HCA)
_MLP_TYPES = ("hash_moe", "moe")
# transformers documents "softmax" too, but its DeepSeek-V4 router cannot build it (no ACT2FN entry):
# without a reference to test against it is refused.
_SCORING = ("sqrtsoftplus", "sigmoid")
_ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class V4Config:
    """Everything the V4 model code reads, checked. Dimensions are in elements.

    ``head_dim`` is the width of the single shared key = value head (512 in the
    real models); its trailing ``qk_rope_head_dim`` channels carry interleaved
    RoPE. ``hf_config`` (the transformers config, for its RoPE initialisers)
    and ``identity`` do not take part in equality.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: tuple[tuple[str, int], ...]
    sliding_window: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_nextn_predict_layers: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    weight_block_size: tuple[int, int] | None
    rope_parameters: dict = field(default_factory=dict, compare=False, hash=False)
    hf_config: Any = field(default=None, compare=False, hash=False, repr=False)
    identity: str = field(default="", compare=False, hash=False, repr=False)

    def layer_type(self, layer: int) -> str:
        """Attention kind of ``layer`` (``0 .. num_layers_with_mtp - 1``): ``layer_types[layer]`` for a main
        layer; an MTP layer attends over the sliding window only (DeepSeek's release builds its block with
        compress ratio 0: no compressed cache, no indexer)."""
        if not 0 <= layer < self.num_layers_with_mtp:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers_with_mtp})")
        return self.layer_types[layer] if layer < self.num_hidden_layers else SLIDING

    def mlp_layer_type(self, layer: int) -> str:
        """FFN kind of ``layer``: ``mlp_layer_types[layer]`` for a main layer, ``moe`` (learned routing) for an
        MTP layer (hash routing is for the first layers of the main stack only)."""
        if not 0 <= layer < self.num_layers_with_mtp:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers_with_mtp})")
        return self.mlp_layer_types[layer] if layer < self.num_hidden_layers else "moe"

    def compress_ratio(self, layer: int) -> int:
        """Tokens per compressed entry of ``layer``: 0 for a sliding-only layer (and the MTP layers)."""
        t = self.layer_type(layer)
        return 0 if t == SLIDING else dict(self.compress_rates)[t]

    def has_indexer(self, layer: int) -> bool:
        """True for CSA layers (they select compressed entries with a lightning indexer)."""
        return self.layer_type(layer) == CSA

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    @property
    def is_fp8(self) -> bool:
        return self.weight_block_size is not None

    @property
    def num_layers_with_mtp(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _build_hf_config(raw: dict):
    from transformers import DeepseekV4Config

    kwargs = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    try:
        return DeepseekV4Config(**kwargs)
    except Exception as e:  # transformers' strict validation; its message names the field
        raise ConfigError(f"DeepseekV4Config rejected config.json: {e}") from e


def _check_rope(rope: dict) -> None:
    for label in ("main", "compress"):
        sub = rope.get(label)
        if not isinstance(sub, dict):
            raise ConfigError(f"rope_parameters.{label} must be an object, got {sub!r}")
        rtype = sub.get("rope_type", "default")
        if rtype not in _ROPE_TYPES:
            raise ConfigError(f"rope_parameters.{label}.rope_type {rtype!r} is not supported; expected one of {_ROPE_TYPES}")


def v4_config_from_dict(raw: dict) -> V4Config:
    """Build a ``V4Config`` from the parsed contents of a ``deepseek_v4`` config.json."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
    if raw.get("model_type") != "deepseek_v4":
        raise ConfigError(f"model_type {raw.get('model_type')!r} is not 'deepseek_v4'")
    mtp = raw.get("num_nextn_predict_layers", 1)
    if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
        raise ConfigError(f"num_nextn_predict_layers must be >= 0, got {mtp!r}")
    hf = _build_hf_config(raw)

    n = _positive("num_hidden_layers", hf.num_hidden_layers)
    heads = _positive("num_attention_heads", hf.num_attention_heads)
    head_dim = _positive("head_dim", hf.head_dim)
    if hf.num_key_value_heads != 1:
        # One shared key = value head is what the cache formats and kernels hold.
        raise ConfigError(f"num_key_value_heads must be 1 for DeepSeek-V4 (shared-KV MQA), got {hf.num_key_value_heads!r}")
    rope_dim = int(hf.qk_rope_head_dim)
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim:
        raise ConfigError(
            f"qk_rope_head_dim (head_dim * partial_rotary_factor = {rope_dim}) must be a positive even number "
            f"<= head_dim ({head_dim})")
    o_groups = _positive("o_groups", hf.o_groups)
    if heads % o_groups:
        raise ConfigError(f"o_groups {o_groups} must divide num_attention_heads ({heads})")
    _positive("o_lora_rank", hf.o_lora_rank)
    _positive("q_lora_rank", hf.q_lora_rank)
    layer_types = tuple(hf.layer_types)
    mlp_types = tuple(hf.mlp_layer_types)
    for name, types, allowed in (("layer_types", layer_types, _LAYER_TYPES), ("mlp_layer_types", mlp_types, _MLP_TYPES)):
        if len(types) != n:
            raise ConfigError(f"{name} has {len(types)} entries but num_hidden_layers is {n}: {list(types)!r}")
        for i, t in enumerate(types):
            if t not in allowed:
                raise ConfigError(f"{name}[{i}] is {t!r}; expected one of {allowed}")
    rates = dict(hf.compress_rates or {})
    for t in (CSA, HCA):
        if t in layer_types:
            _positive(f"compress_rates[{t!r}]", rates.get(t))
    _positive("sliding_window", hf.sliding_window)
    _positive("hc_mult", hf.hc_mult)
    _positive("hc_sinkhorn_iters", hf.hc_sinkhorn_iters)
    if CSA in layer_types:
        _positive("index_topk", hf.index_topk)
        _positive("index_n_heads", hf.index_n_heads)
        idx_dim = _positive("index_head_dim", hf.index_head_dim)
        if idx_dim < rope_dim:
            raise ConfigError(f"index_head_dim ({idx_dim}) must be >= qk_rope_head_dim ({rope_dim}): "
                              "the indexer rotates its trailing qk_rope_head_dim channels")
    if hf.scoring_func not in _SCORING:
        raise ConfigError(f"scoring_func {hf.scoring_func!r} is not supported; expected one of {_SCORING}")
    if hf.hidden_act != "silu":
        raise ConfigError(f"hidden_act {hf.hidden_act!r} is not supported; DeepSeek-V4 uses 'silu'")
    if hf.n_shared_experts != 1:
        # transformers builds exactly one shared MLP of moe_intermediate_size whatever this says.
        raise ConfigError(f"n_shared_experts must be 1 for DeepSeek-V4, got {hf.n_shared_experts!r}")
    if getattr(hf, "mlp_bias", False):
        raise ConfigError("mlp_bias true is not supported for DeepSeek-V4")
    if not 1 <= hf.num_experts_per_tok <= hf.n_routed_experts:
        raise ConfigError(f"num_experts_per_tok {hf.num_experts_per_tok!r} must be in [1, n_routed_experts="
                          f"{hf.n_routed_experts}]")
    rope = dict(hf.rope_parameters or {})
    _check_rope(rope)
    eos = hf.eos_token_id
    eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
    return V4Config(
        arch="deepseek_v4",
        vocab_size=_positive("vocab_size", hf.vocab_size),
        hidden_size=_positive("hidden_size", hf.hidden_size),
        moe_intermediate_size=_positive("moe_intermediate_size", hf.moe_intermediate_size),
        num_hidden_layers=n,
        num_attention_heads=heads,
        head_dim=head_dim,
        qk_rope_head_dim=rope_dim,
        q_lora_rank=hf.q_lora_rank,
        o_groups=o_groups,
        o_lora_rank=hf.o_lora_rank,
        n_routed_experts=_positive("n_routed_experts", hf.n_routed_experts),
        n_shared_experts=hf.n_shared_experts,
        num_experts_per_tok=hf.num_experts_per_tok,
        scoring_func=hf.scoring_func,
        routed_scaling_factor=float(hf.routed_scaling_factor),
        swiglu_limit=float(hf.swiglu_limit),
        layer_types=layer_types,
        mlp_layer_types=mlp_types,
        compress_rates=tuple(sorted((k, int(v)) for k, v in rates.items())),
        sliding_window=hf.sliding_window,
        hc_mult=hf.hc_mult,
        hc_sinkhorn_iters=hf.hc_sinkhorn_iters,
        hc_eps=float(hf.hc_eps),
        index_n_heads=hf.index_n_heads,
        index_head_dim=hf.index_head_dim,
        index_topk=hf.index_topk,
        num_nextn_predict_layers=mtp,
        rms_norm_eps=float(hf.rms_norm_eps),
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        max_position_embeddings=hf.max_position_embeddings,
        bos_token_id=hf.bos_token_id,
        eos_token_ids=eos_ids,
        weight_block_size=parse_quantization_config(raw),
        rope_parameters=rope,
        hf_config=hf,
        identity=config_identity(raw),
    )
