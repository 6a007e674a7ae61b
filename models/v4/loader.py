"""Load a DeepSeek-V4 checkpoint (``model_type: deepseek_v4``) into ``DeepseekV4ForCausalLM``.

Checkpoint names follow DeepSeek's release (``embed.weight``,
``layers.N.attn.wq_a.weight``, ``layers.N.ffn.experts.E.w1.weight``,
``layers.N.hc_attn_fn``, ``hc_head_fn``, ``head.weight``, ``mtp.0.*``);
transformers' ``save_pretrained`` writes the same names under ``model.``,
except ``model.embed_tokens.weight`` and ``model.hc_head.hc_{fn,base,scale}``.
``v4_module_name`` maps both spellings onto this package's modules.

The MTP layer ``mtp.{d}.*`` (``models.v4.mtp``): its block's tensors are named as a main
layer's and renamed the same way (``mtp.0.hc_attn_fn`` -> ``mtp.0.hc_attn.fn``, experts'
``w1 / w3 / w2``), plus ``enorm``, ``hnorm``, ``e_proj``, ``h_proj``, ``norm`` and
``hc_head_{fn,base,scale}``. It reads the main model's ``embed`` and ``head``; copies of them
a checkpoint may carry under ``mtp.{d}`` are not read.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from models.loader import load_weights
from models.v4.config import V4Config
from models.v4.model import DeepseekV4ForCausalLM

_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")
_MTP = re.compile(r"^mtp\.(\d+)\.(.*)$")
_MTP_HEAD = re.compile(r"^hc_head_(fn|base|scale)$")
_MTP_SHARED = ("head.", "embed.", "emb.", "embed_tokens.", "shared_head.")
_EXPERT = re.compile(r"^(ffn\.experts\.\d+)\.(w1|w2|w3)\.(weight.*)$")
_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_HC = re.compile(r"^hc_(attn|ffn)_(fn|base|scale)$")
_TOP = {
    "embed.weight": "embed.weight", "embed_tokens.weight": "embed.weight",
    "head.weight": "head.weight", "lm_head.weight": "head.weight",
    "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.fn", "hc_head_base": "hc_head.base", "hc_head_scale": "hc_head.scale",
    "hc_head.hc_fn": "hc_head.fn", "hc_head.hc_base": "hc_head.base", "hc_head.hc_scale": "hc_head.scale",
}


def v4_module_name(ckpt_name: str, cfg: V4Config, with_mtp: bool = True) -> str | None:
    """Parameter name of ``DeepseekV4ForCausalLM`` for a checkpoint tensor name; ``None`` = not
    held here (layers past ``num_hidden_layers``, MTP layers past ``num_nextn_predict_layers`` or
    any without ``with_mtp``, the MTP layer's copies of ``embed`` / ``head``, unknown names)."""
    name = ckpt_name[len("model."):] if ckpt_name.startswith("model.") else ckpt_name
    if name in _TOP:
        return _TOP[name]
    m = _MTP.match(name)
    if m is not None:
        depth, rest = int(m.group(1)), m.group(2)
        if not with_mtp or depth >= cfg.num_nextn_predict_layers or rest.startswith(_MTP_SHARED):
            return None
        head = _MTP_HEAD.match(rest)
        return f"mtp.{depth}.hc_head.{head.group(1)}" if head else f"mtp.{depth}.{_block_name(rest)}"
    m = _LAYER.match(name)
    if m is None:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    if layer >= cfg.num_hidden_layers:
        return None
    return f"layers.{layer}.{_block_name(rest)}"


def _block_name(rest: str) -> str:
    """A block's tensor name (after ``layers.N.`` / ``mtp.D.``) as ``V4Block`` names it."""
    hc = _HC.match(rest)
    if hc:
        return f"hc_{hc.group(1)}.{hc.group(2)}"
    ex = _EXPERT.match(rest)
    if ex:
        return f"{ex.group(1)}.{_EXPERT_PROJ[ex.group(2)]}.{ex.group(3)}"
    return rest


def load_v4_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                  cfg: V4Config | None = None, with_mtp: bool = True) -> DeepseekV4ForCausalLM:
    """Config and weights of a ``deepseek_v4`` checkpoint. Tensors are read in fp32 (fp8
    ones dequantized) and cast to each parameter's dtype: norm weights, sinks, position
    biases and hyper-connection parameters stay fp32 as in the reference model.
    with_mtp: also the MTP layers the config declares (``num_nextn_predict_layers``);
    False: none, and ``mtp.*`` tensors are not read.
    Raises ``ValueError`` naming every missing tensor (an MTP layer's too: a checkpoint
    that declares one must hold it, or be loaded with ``with_mtp=False``)."""
    if cfg is None:
        from models.registry import read_config_json
        from models.v4.config import v4_config_from_dict

        cfg = v4_config_from_dict(read_config_json(model_dir))
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg, dtype=dtype, with_mtp=with_mtp)
    try:
        return load_weights(model, model_dir, lambda n: v4_module_name(n, cfg, with_mtp), device=device,
                            read_dtype=torch.float32, tie_word_embeddings=cfg.tie_word_embeddings,
                            tied=("head.weight", "embed.weight"))
    except ValueError as e:
        missing = str(e).partition("lacks weights for:")[2]
        if len(model.mtp) and "mtp." in missing:
            raise ValueError(f"{e} (config.json declares num_nextn_predict_layers "
                             f"{cfg.num_nextn_predict_layers}: the MTP layer's mtp.N.* tensors must be in the "
                             "checkpoint, or load it with with_mtp=False)") from e
        raise
