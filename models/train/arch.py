"""Architectures of the trained small models: transformers config kwargs (``deepseek_v32``).

``SMALL_V32`` is the shipped model: every DeepSeek-V3.2 feature live at a
small width.

- MLA with a q LoRA (96) and the real models' latent and rope widths (512 +
  64), so the same checkpoint runs on the ``reference`` backend (CPU) and on
  the ``cuda`` one (FlashMLA and DeepGEMM take only those shapes);
- the lightning indexer with the real 64 heads x 128 dims and
  ``index_topk`` 64 over a 1024-token context: beyond 64 tokens every
  query attends to the 64 positions its indexer picks;
- a dense first layer, then MoE layers of 16 routed experts in 4 groups
  (2 groups chosen, 4 experts a token) plus a shared expert, sigmoid routing
  with the aux-loss-free correction bias;
- one MTP (next-n) layer.

About 19M parameters, of which ~10M in four copies of the 4096 x 256
embedding / head (the MTP layer's copies are written out, as in the real
releases): a 37 MB bf16 checkpoint.

``PIPELINE_TEST`` is a toy of the same structure for the CPU test of the
training pipeline.
"""

from __future__ import annotations

__all__ = ["ARCHS", "SMALL_V32", "PIPELINE_TEST", "arch_kwargs"]

SMALL_V32 = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=96,
    kv_lora_rank=512,
    qk_nope_head_dim=32,
    qk_rope_head_dim=64,
    v_head_dim=32,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=64,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    num_nextn_predict_layers=1,
)

PIPELINE_TEST = dict(
    SMALL_V32,
    vocab_size=512,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=4,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    index_n_heads=4,
    index_head_dim=16,
    index_topk=8,
    max_position_embeddings=64,
    initializer_range=0.05,
)

ARCHS = {"small_v32": SMALL_V32, "pipeline_test": PIPELINE_TEST}


def arch_kwargs(name: str, vocab_size: int | None = None) -> dict:
    """A copy of architecture ``name``'s kwargs, with ``vocab_size`` set from the tokenizer when given."""
    if name not in ARCHS:
        raise ValueError(f"unknown architecture {name!r}; known: {sorted(ARCHS)}")
    kw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in ARCHS[name].items()}
    if vocab_size is not None:
        kw["vocab_size"] = vocab_size
    return kw
