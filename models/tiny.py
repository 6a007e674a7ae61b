"""Tiny random checkpoints that keep every architectural feature of the real models.

``make_tiny("deepseek_v32" | "glm_moe_dsa", out_dir)`` writes a HF-format
checkpoint that transformers loads with ``AutoModelForCausalLM`` plus, like
the real releases, MTP (next-n) layer weights that transformers ignores:

- MLA with q LoRA, a DSA indexer per layer (``index_topk`` 16, so attention
  is really sparse beyond 16 tokens), a dense first layer then MoE layers
  with a shared expert and group-limited routing (DeepSeek-V3.2: 8 experts
  in 2 groups, 1 group chosen; GLM-5: 1 group), YaRN RoPE for DeepSeek-V3.2;
  GLM-5: cross-layer top-k sharing (``index_topk_freq`` 2, offset 1: layers
  F S F S) and interleaved indexer RoPE.
- One MTP layer at index ``L = num_hidden_layers`` under DeepSeek's names
  (``model.layers.L.{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head,
  embed_tokens}`` and a full MoE decoder layer with its own indexer) in a
  second shard, with ``model.safetensors.index.json`` over both.  As in the
  real checkpoints, the MTP ``embed_tokens`` / ``shared_head.head`` equal the
  main ``embed_tokens`` / ``lm_head``.
- A byte-level tokenizer: ids 0..255 are the bytes themselves, then
  ``<|bos|>`` 256, ``<|eos|>`` 257, ``<|user|>`` 258, ``<|assistant|>`` 259,
  ``<|system|>`` 260.  Encoding adds ``<|bos|>``.  Chat template:
  ``<|bos|>`` then, per message, ``<|ROLE|>`` + content, then ``<|assistant|>``
  when ``add_generation_prompt``.  The vocab (320) is larger than the
  tokenizer, as real vocabularies are padded; lm_head rows other than
  printable ASCII and ``<|eos|>`` are damped so greedy text is readable.
  ``tokenizer="native"`` instead gives the family's real special tokens
  and chat format (`models.tiny_native`: DeepSeek-V3.2 without a chat
  template, GLM-5 with its template), with ``</think>`` among the
  undamped rows, so greedy replies sometimes close a thinking block.

Weights are bfloat16 (``e_score_correction_bias`` float32, as in DeepSeek's
releases) and a function of ``seed`` only: the same seed gives byte-identical
files.  ``fp8=True`` stores the block-quantized form.

transformers' loader lists the MTP tensors as UNEXPECTED in its load report
(its ignore pattern is hard-coded to layer 61 / 78 of the real models); that
is expected and harmless.
"""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .weights import INDEX_FILE, SINGLE_FILE, write_fp8_checkpoint

__all__ = [
    "TINY_ARCHS",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "tiny_config_kwargs",
    "make_tiny",
    "make_tokenizer",
    "add_mtp_shard",
    "decoder_layer_tensors",
    "mtp_layer_config_kwargs",
    "to_checkpoint_dtype_",
]

TINY_ARCHS = ("deepseek_v32", "glm_moe_dsa", "deepseek_v4")
"""``deepseek_v4`` is made by `models.tiny_v4` (transformers' ``DeepseekV4ForCausalLM``)."""
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>")
BOS_ID, EOS_ID = 256, 257
# bos_token first, then `<|role|>content` per message; the prompt for a reply ends in `<|assistant|>`.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    index_n_heads=8,
    index_head_dim=32,
    index_topk=16,
    max_position_embeddings=2048,
    initializer_range=0.1,
    tie_word_embeddings=False,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    num_nextn_predict_layers=1,
)

_PER_ARCH = {
    "deepseek_v32": dict(
        n_group=2,
        topk_group=1,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
    "glm_moe_dsa": dict(
        n_group=1,
        topk_group=1,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        index_topk_freq=2,
        index_skip_topk_offset=1,
    ),
}

# lm_head is scaled so logits spread over a few units: greedy argmax then has
# clear margins and does not flip on rounding differences between backends.
_LM_HEAD_SCALE = 3.0
# Other rows are damped so greedy output is mostly printable ASCII, with an
# occasional <|eos|> to exercise stop handling.
_FAVOURED_IDS = (*range(0x20, 0x7F), EOS_ID)
_UNUSED_ROW_SCALE = 0.1


def tiny_config_kwargs(arch: str, **overrides) -> dict:
    """Keyword arguments of the transformers config class for a tiny ``arch`` model."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch must be one of {TINY_ARCHS}, got {arch!r}")
    if arch == "deepseek_v4":
        from .tiny_v4 import v4_tiny_config_kwargs

        return v4_tiny_config_kwargs(**overrides)
    kwargs = {**copy.deepcopy(_COMMON), **copy.deepcopy(_PER_ARCH[arch]), **overrides}
    return kwargs


def _config_class(arch: str):
    from transformers import DeepseekV32Config, GlmMoeDsaConfig

    return {"deepseek_v32": DeepseekV32Config, "glm_moe_dsa": GlmMoeDsaConfig}[arch]


def _model_class(arch: str):
    from transformers import DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM

    return {"deepseek_v32": DeepseekV32ForCausalLM, "glm_moe_dsa": GlmMoeDsaForCausalLM}[arch]


def _perturb_(model: torch.nn.Module, gen: torch.Generator, favoured_ids: Sequence[int] | None) -> None:
    """Move the parameters transformers initialises to constants off them.

    Norm weights of exactly 1, zero norm biases and zero routing biases would
    let a loader that forgets them pass every test.
    """
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()) + sorted(model.named_buffers()):
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name and leaf == "weight":
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "norm" in name and leaf == "bias":
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif leaf == "e_score_correction_bias":
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
        head = model.get_output_embeddings().weight
        head.mul_(_LM_HEAD_SCALE)
        if favoured_ids is not None:
            damp = torch.full((head.shape[0], 1), _UNUSED_ROW_SCALE)
            damp[list(favoured_ids)] = 1.0
            head.mul_(damp)


def to_checkpoint_dtype_(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast ``model`` to ``dtype`` in place, the routing bias kept float32."""
    model.to(dtype)
    # DeepSeek's releases keep the routing bias in float32.
    for module in model.modules():
        b = getattr(module, "e_score_correction_bias", None)
        if isinstance(b, torch.Tensor):
            module.e_score_correction_bias = b.to(torch.float32)


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt", device="cpu") as h:
        return {k: h.get_tensor(k) for k in h.keys()}


def decoder_layer_tensors(aux_model: torch.nn.Module, layer_idx: int) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of ``aux_model``'s only decoder layer, renamed to layer ``layer_idx``.

    ``aux_model``: a one-layer transformers causal LM. It is saved with
    ``save_pretrained``, so the names (per-expert ones included) are
    transformers' own checkpoint format; ``model.layers.0.`` is renamed.
    """
    with tempfile.TemporaryDirectory() as tmp:
        aux_model.save_pretrained(tmp)
        tensors = _read_all(Path(tmp) / SINGLE_FILE)
    prefix = "model.layers.0."
    return {f"model.layers.{layer_idx}." + k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def mtp_layer_config_kwargs(cfg_kwargs: dict, arch: str) -> dict:
    """Config kwargs of a one-layer model whose layer is an MTP block's decoder (MoE, own indexer)."""
    aux_kwargs = dict(cfg_kwargs, num_hidden_layers=1, first_k_dense_replace=0, mlp_layer_types=["sparse"])
    for k in ("index_topk_freq", "index_skip_topk_offset", "index_topk_pattern", "indexer_types"):
        aux_kwargs.pop(k, None)
    if arch == "glm_moe_dsa":
        aux_kwargs["indexer_types"] = ["full"]
    return aux_kwargs


def _mtp_layer_tensors(
    arch: str, cfg_kwargs: dict, layer_idx: int, seed: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Random decoder-layer weights (attention + indexer + MoE) for MTP layer ``layer_idx``."""
    aux_cfg = _config_class(arch)(**mtp_layer_config_kwargs(cfg_kwargs, arch))
    torch.manual_seed(seed)
    aux = _model_class(arch)(aux_cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    _perturb_(aux, gen, favoured_ids=None)
    to_checkpoint_dtype_(aux, dtype)
    return decoder_layer_tensors(aux, layer_idx)


def add_mtp_shard(out: Path, mtp: dict[str, torch.Tensor]) -> None:
    """Turn ``out``'s single ``model.safetensors`` (as ``save_pretrained`` wrote it) into two
    shards, the main weights then the MTP tensors ``mtp``, with ``model.safetensors.index.json``
    over both: the layout of the real releases, whose MTP layer sits in its own file."""
    main_file = out / SINGLE_FILE
    if not main_file.exists():
        raise RuntimeError(f"expected save_pretrained to write one {SINGLE_FILE} in {out}")
    main = _read_all(main_file)
    clash = sorted(set(main) & set(mtp))
    if clash:
        raise ValueError(f"MTP tensors overlap the main checkpoint's: {clash[:4]}")
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    main_file.rename(out / names[0])
    save_file(dict(sorted(mtp.items())), str(out / names[1]), metadata={"format": "pt"})
    weight_map = {n: names[0] for n in main} | {n: names[1] for n in mtp}
    total = sum(t.numel() * t.element_size() for t in [*main.values(), *mtp.values()])
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def make_tokenizer():
    """The byte-level tokenizer described in the module docstring (a PreTrainedTokenizerFast)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    # Byte-level BPE spells each byte as a printable character; id = byte value.
    alphabet = _byte_alphabet()
    vocab = {alphabet[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        additional_special_tokens=list(SPECIAL_TOKENS[2:]),
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=_COMMON["max_position_embeddings"],
    )


def _byte_alphabet() -> list[str]:
    """Printable stand-in character for each byte value (the GPT-2 byte-level convention)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _clear_checkpoint(out: Path) -> None:
    for p in list(out.glob("*.safetensors")) + [out / INDEX_FILE]:
        if p.exists():
            p.unlink()


def _tokenizer_and_favoured(arch: str, kind: str):
    """The tokenizer of ``kind`` ("byte" or "native") and the lm_head rows left undamped."""
    if kind == "byte":
        return make_tokenizer(), _FAVOURED_IDS
    if kind != "native":
        raise ValueError(f"tokenizer must be 'byte' or 'native', got {kind!r}")
    from .tiny_native import make_native_tokenizer

    tok = make_native_tokenizer(arch, _byte_alphabet(), _COMMON["max_position_embeddings"])
    return tok, (*_FAVOURED_IDS, tok.convert_tokens_to_ids("</think>"))


def _write_bf16(arch: str, out: Path, seed: int, dtype: torch.dtype, overrides: dict, tokenizer_kind: str = "byte") -> None:
    cfg_kwargs = tiny_config_kwargs(arch, **overrides)
    n_mtp = int(cfg_kwargs.get("num_nextn_predict_layers", 0))
    cfg = _config_class(arch)(**cfg_kwargs)
    tokenizer, favoured = _tokenizer_and_favoured(arch, tokenizer_kind)
    if cfg.vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {cfg.vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")

    torch.manual_seed(seed)
    model = _model_class(arch)(cfg).eval()
    _perturb_(model, torch.Generator().manual_seed(seed), favoured_ids=favoured)
    to_checkpoint_dtype_(model, dtype)

    _clear_checkpoint(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if n_mtp == 0:
        return

    main = _read_all(out / SINGLE_FILE)
    L = cfg.num_hidden_layers
    mtp: dict[str, torch.Tensor] = {}
    for k in range(n_mtp):
        idx = L + k
        gen = torch.Generator().manual_seed(seed * 1000 + 17 + k)
        h = cfg.hidden_size
        std = cfg.initializer_range
        mtp[f"model.layers.{idx}.enorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
        mtp[f"model.layers.{idx}.hnorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
        mtp[f"model.layers.{idx}.eh_proj.weight"] = std * torch.randn(h, 2 * h, generator=gen)
        mtp[f"model.layers.{idx}.shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
        mtp = {n: t.to(dtype) for n, t in mtp.items()}
        mtp[f"model.layers.{idx}.shared_head.head.weight"] = main["lm_head.weight"].clone()
        mtp[f"model.layers.{idx}.embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
        mtp.update(_mtp_layer_tensors(arch, cfg_kwargs, idx, seed * 1000 + 1 + k, dtype))
    add_mtp_shard(out, mtp)


def make_tiny(
    arch: str,
    out_dir: str | Path,
    seed: int = 0,
    *,
    fp8: bool = False,
    fp8_block: Sequence[int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
    tokenizer: str = "byte",
    **overrides,
) -> Path:
    """Write a tiny random ``arch`` checkpoint (config, weights, tokenizer) to ``out_dir``.

    Args:
        arch: "deepseek_v32", "glm_moe_dsa" or "deepseek_v4" (`models.tiny_v4`; bf16, byte tokenizer).
        out_dir: created if missing; existing safetensors there are replaced.
        seed: all weights are a function of it.
        fp8: store attention / MLP / expert projections block-quantized
            (float8_e4m3fn + float32 ``weight_scale_inv``, ``fp8_block``).
        dtype: storage dtype of the other weights (default bfloat16).
        tokenizer: "byte" (the module docstring's) or "native" (the family's real
            special tokens and chat format, `models.tiny_native`).
        **overrides: transformers config fields, e.g. ``num_hidden_layers=6``,
            ``index_topk=8``, ``num_nextn_predict_layers=0``.

    Returns:
        ``out_dir`` as a Path.
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch must be one of {TINY_ARCHS}, got {arch!r}")
    if arch == "deepseek_v4":
        if fp8 or tokenizer != "byte":
            raise ValueError("the tiny deepseek_v4 model is bf16 with the byte tokenizer only (fp8 and the native "
                             "tokenizer are not built for it)")
        from .tiny_v4 import make_tiny_v4

        return make_tiny_v4(out_dir, seed, dtype=dtype, **overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Seeding inside fork_rng leaves the caller's global RNG stream untouched.
    with torch.random.fork_rng(devices=[]):
        if not fp8:
            _write_bf16(arch, out, seed, dtype, overrides, tokenizer)
            return out
        with tempfile.TemporaryDirectory() as tmp:
            _write_bf16(arch, Path(tmp), seed, dtype, overrides, tokenizer)
            _clear_checkpoint(out)
            write_fp8_checkpoint(tmp, out, block=fp8_block)
    return out
