"""A tiny random DeepSeek-V4 checkpoint, built and saved by transformers' own
``DeepseekV4ForCausalLM`` (``make_tiny("deepseek_v4", out)`` dispatches here).

Every V4 feature the engine serves is in it, at dims unlike the real model's:
the three attention kinds (sliding window, CSA with its indexer, HCA), a
hash-routed MoE layer first then learned top-k MoE layers, hyper-connections
(3 streams), partial interleaved RoPE, attention sinks. The window (8) and the
compression rates (CSA 4, HCA 8) are small so that a 40-token prompt crosses
several windows and compressed blocks, and ``index_topk`` (3) is below the
entry count, so the indexer really selects.

The tokenizer is ``models.tiny``'s byte-level one (vocab 320, ``<|eos|>`` 257);
lm_head rows other than printable ASCII and ``<|eos|>`` are damped, as there,
so greedy text is readable. One MTP layer (``num_nextn_predict_layers`` 1,
``models.v4.mtp``) is written under DeepSeek's names (``mtp.0.*``) in a second
shard, with ``model.safetensors.index.json`` over both, as ``models.tiny`` does
for V3.2: transformers has no MTP module, so its block (sliding window, learned
MoE, hyper-connections), ``hc_head`` and ``norm`` come from a one-layer model of
transformers' own, and ``enorm`` / ``hnorm`` / ``e_proj`` / ``h_proj`` are drawn
here, all random. ``num_nextn_predict_layers=0`` writes none.
Weights are bfloat16 (fp32 where transformers keeps them fp32: norms, sinks,
position biases, hyper-connections) and a function of ``seed`` only.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

V4_TINY = dict(
    vocab_size=320, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, head_dim=32, q_lora_rank=40, partial_rotary_factor=0.5,
    num_experts_per_tok=2, n_routed_experts=8, o_groups=2, o_lora_rank=24,
    index_n_heads=4, index_head_dim=24, index_topk=3, sliding_window=8,
    compress_rates={CSA: 4, HCA: 8}, layer_types=[SWA, CSA, HCA, CSA],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"], hc_mult=3, hc_sinkhorn_iters=6,
    max_position_embeddings=2048, initializer_range=0.1, num_nextn_predict_layers=1,
    tie_word_embeddings=False,
)
"""transformers ``DeepseekV4Config`` kwargs of the tiny model (bos / eos come from the tokenizer)."""

_LM_HEAD_SCALE = 3.0
_UNUSED_ROW_SCALE = 0.1


def v4_tiny_config_kwargs(**overrides) -> dict:
    """The tiny V4 model's config kwargs (``DeepseekV4Config``), with ``overrides``."""
    from models.tiny import BOS_ID, EOS_ID

    return {**copy.deepcopy(V4_TINY), "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, **overrides}


def make_tiny_v4(out_dir: str | Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16, **overrides) -> Path:
    """Write the tiny V4 checkpoint (config.json, safetensors, byte tokenizer) to ``out_dir``."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from models.tiny import add_mtp_shard, make_tokenizer
    from models.weights import INDEX_FILE

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for p in [*out.glob("*.safetensors"), out / INDEX_FILE]:
        p.unlink(missing_ok=True)
    tokenizer = make_tokenizer()
    kwargs = v4_tiny_config_kwargs(**overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        cfg = DeepseekV4Config(**kwargs)
        if cfg.vocab_size < len(tokenizer):
            raise ValueError(f"vocab_size {cfg.vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
        model = DeepseekV4ForCausalLM(cfg).eval()
        _perturb_v4_(model, torch.Generator().manual_seed(seed + 1))
    _save(model, out, dtype)
    tokenizer.save_pretrained(out)
    if cfg.num_nextn_predict_layers:
        add_mtp_shard(out, {n: t for d in range(cfg.num_nextn_predict_layers)
                            for n, t in _mtp_tensors(kwargs, d, seed, dtype).items()})
    return out


def _save(model: torch.nn.Module, out: Path, dtype: torch.dtype) -> None:
    """``save_pretrained`` with every parameter but those DeepSeek keeps in fp32 cast to ``dtype``."""
    keep_fp32 = {n for n, p in model.named_parameters() if p.dtype == torch.float32 and _stays_fp32(n)}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n not in keep_fp32:
                p.data = p.data.to(dtype)
    model.save_pretrained(out)


def _mtp_tensors(kwargs: dict, depth: int, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random tensors of MTP layer ``depth`` under DeepSeek's names (``mtp.{depth}.*``): the block, ``hc_head``
    and ``norm`` of a one-layer transformers model whose layer is what the MTP block is (sliding window,
    learned MoE), dtypes as the main checkpoint's; ``enorm`` / ``hnorm`` (fp32) and ``e_proj`` / ``h_proj``."""
    from safetensors.torch import load_file
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from models.weights import SINGLE_FILE

    aux_kwargs = dict(kwargs, num_hidden_layers=1, layer_types=[SWA], mlp_layer_types=["moe"],
                      num_nextn_predict_layers=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1000 + 17 + depth)
        aux = DeepseekV4ForCausalLM(DeepseekV4Config(**aux_kwargs)).eval()
        perturb_v4_constants_(aux, torch.Generator().manual_seed(seed * 1000 + 18 + depth))
    with tempfile.TemporaryDirectory() as tmp:
        _save(aux, Path(tmp), dtype)
        saved = load_file(str(Path(tmp) / SINGLE_FILE))
    p = f"mtp.{depth}."
    out = {p + n[len("model.layers.0."):]: t for n, t in saved.items() if n.startswith("model.layers.0.")}
    for part in ("fn", "base", "scale"):
        out[f"{p}hc_head_{part}"] = saved[f"model.hc_head.hc_{part}"]
    out[p + "norm.weight"] = saved["model.norm.weight"]
    g = torch.Generator().manual_seed(seed * 1000 + 19 + depth)
    D, std = kwargs["hidden_size"], kwargs["initializer_range"]
    for name in ("enorm", "hnorm"):
        out[f"{p}{name}.weight"] = 1 + 0.2 * torch.randn(D, generator=g)
    for name in ("e_proj", "h_proj"):
        out[f"{p}{name}.weight"] = (std * torch.randn(D, D, generator=g)).to(dtype)
    return out


def _stays_fp32(name: str) -> bool:
    """Parameters DeepSeek's V4 release keeps in fp32 (and ``models.v4`` declares fp32)."""
    return name.endswith(("norm.weight", "sinks", "position_bias", "e_score_correction_bias")) or ".hc" in name \
        or name.startswith("model.hc_head") or "hc_" in name


def perturb_v4_constants_(model: torch.nn.Module, g: torch.Generator) -> None:
    """Random values for what transformers' ``DeepseekV4ForCausalLM`` initialises to constants: the
    hash-routing table, attention sinks, position biases, routing biases, hyper-connection bases,
    norm weights."""
    cfg = model.config
    with torch.no_grad():
        for n, p in [*model.named_parameters(), *model.named_buffers()]:
            if n.endswith("tid2eid"):
                rows = [torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok]
                        for _ in range(p.shape[0])]
                p.copy_(torch.stack(rows))
            elif n.endswith(("sinks", "position_bias", "e_score_correction_bias", "hc.base", "hc_head.hc_base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))


def _perturb_v4_(model: torch.nn.Module, g: torch.Generator) -> None:
    """Move what transformers initialises to constants off them (a loader that forgets a sink,
    a position bias, a norm or the hash table must fail the tests), scale lm_head so greedy
    has clear margins, damp the rows the byte tokenizer never prints."""
    from models.tiny import _FAVOURED_IDS

    perturb_v4_constants_(model, g)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.mul_(_LM_HEAD_SCALE)
        damp = torch.full((head.shape[0], 1), _UNUSED_ROW_SCALE)
        damp[list(_FAVOURED_IDS)] = 1.0
        head.mul_(damp)
