"""The physical floor of a decode step: bytes it must read once from HBM / the GPU's bandwidth.

What one graphed decode step (`bench/engine.py`: embedding to final norm, no lm_head) cannot avoid
reading, per layer:

* every attention, indexer and dense-MLP weight (each is used by every token);
* the shared experts, and the routed experts the batch routes to: their expected union under
  uniform routing, ``E * (1 - (1 - k / E) ** tokens)`` (a random-weight router is close to uniform;
  at batch 1 it is exactly the ``k`` routed experts);
* the KV cache the sparse attention reads (``min(top-k, context)`` selected tokens per query token
  and computing layer, in the cache's bytes per token) and the indexer keys it scores (every
  context token of every computing layer).

Weights are counted in their stored dtype (fp8 + scales, or bf16), so the same model in fp8 has a
lower floor. ``hbm_bytes_per_s`` takes the GPU's name: the datasheet bandwidth of the SXM parts.
"""

from __future__ import annotations

from dataclasses import dataclass

from attention.formats import PAGE_SIZE

HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}


def hbm_bytes_per_s(device_name: str) -> float:
    for key, bw in HBM_BYTES_PER_S.items():
        if key in device_name:
            return bw
    raise ValueError(f"no HBM bandwidth on record for {device_name!r}: add it to bench/roofline.py")


def _bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@dataclass(frozen=True)
class StepBytes:
    dense_weights: int  # attention, indexer, dense MLP, shared experts, norms: read whole every step
    routed_experts: int  # the expected union of the routed experts the step's tokens pick
    kv_cache: int  # selected latents + scored indexer keys

    @property
    def total(self) -> int:
        return self.dense_weights + self.routed_experts + self.kv_cache


def decode_step_bytes(model, tokens: int, contexts: list[int], width: int, cache_spec) -> StepBytes:
    """The bytes a decode step of ``tokens`` query tokens (``len(contexts)`` requests of ``width``
    tokens each, request ``b`` ending at context ``contexts[b]``) must read, main layers only."""
    from models.moe.layer import MoE

    dense = routed = 0
    for layer in model.layers:
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            ex = mlp.experts
            per_expert = _bytes(ex) / ex.num_local
            k = model.cfg.num_experts_per_tok
            union = ex.num_local * (1 - (1 - k / ex.num_local) ** tokens)
            routed += int(per_expert * union)
            dense += _bytes(layer) - _bytes(ex)
        else:
            dense += _bytes(layer)
    topk = model.cfg.index_topk
    mla_token = cache_spec.mla_bytes_per_page() // PAGE_SIZE
    index_token = cache_spec.index_bytes_per_page() // PAGE_SIZE
    n_layers = len(model.layers)
    computing = sum(1 for layer in model.layers if layer.self_attn.indexer is not None)
    kv = 0
    for ctx in contexts:
        kv += width * n_layers * min(topk, ctx) * mla_token
        kv += width * computing * ctx * index_token
    return StepBytes(dense, routed, kv)
