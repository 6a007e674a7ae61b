"""Checkpoint reading and fp8 block quantization.

Checkpoints are HF safetensors directories: one ``model.safetensors`` or
shards listed by ``model.safetensors.index.json``.  fp8 checkpoints
(DeepSeek-V3.2 / GLM-5-FP8 style) store a projection weight ``X.weight`` as
float8_e4m3fn ``[out, in]`` plus ``X.weight_scale_inv`` float32
``[ceil(out / b0), ceil(in / b1)]``: the real weight is the fp8 value times
the scale of its ``b0 x b1`` block (blocks at the right/bottom edge are
partial).  The block size comes from ``quantization_config.weight_block_size``.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ConfigError, parse_quantization_config

__all__ = [
    "FP8_MAX",
    "FP8_QUANTIZATION_CONFIG",
    "SCALE_SUFFIX",
    "checkpoint_files",
    "checkpoint_tensor_names",
    "checkpoint_block_size",
    "dequantize_fp8_block",
    "fp8_scale_shape",
    "is_fp8_quantizable",
    "iter_checkpoint_tensors",
    "load_checkpoint",
    "quantize_fp8_block",
    "write_fp8_checkpoint",
]

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def fp8_scale_shape(weight_shape: Sequence[int], block: Sequence[int]) -> tuple[int, int]:
    """Shape of ``weight_scale_inv`` for a 2-D weight ``[out, in]`` and block ``(b0, b1)``."""
    out_f, in_f = weight_shape
    return (math.ceil(out_f / block[0]), math.ceil(in_f / block[1]))


def _expand_scale(scale: torch.Tensor, shape: Sequence[int], block: Sequence[int]) -> torch.Tensor:
    # Repeat each block's scale over its block, then crop the partial edge blocks.
    out_f, in_f = shape
    return scale.repeat_interleave(block[0], dim=0)[:out_f].repeat_interleave(block[1], dim=1)[:, :in_f]


def quantize_fp8_block(
    w: torch.Tensor, block: Sequence[int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize a 2-D weight to fp8 e4m3.

    Args:
        w: ``[out, in]`` floating tensor, any float dtype.
        block: ``(b0, b1)`` block size; edge blocks may be partial.

    Returns:
        ``(w_fp8, scale_inv)``: ``w_fp8`` float8_e4m3fn ``[out, in]`` and
        ``scale_inv`` float32 ``[ceil(out/b0), ceil(in/b1)]`` holding each
        block's ``amax / 448``, so that ``w ~= w_fp8 * scale_inv`` per block.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_block needs a 2-D weight, got shape {tuple(w.shape)}")
    b0, b1 = int(block[0]), int(block[1])
    out_f, in_f = w.shape
    s0, s1 = fp8_scale_shape(w.shape, (b0, b1))
    wf = w.detach().to(torch.float32)
    padded = torch.zeros(s0 * b0, s1 * b1, dtype=torch.float32, device=w.device)
    padded[:out_f, :in_f] = wf
    amax = padded.view(s0, b0, s1, b1).abs().amax(dim=(1, 3))
    # An all-zero block would otherwise give a zero scale and 0/0 on the way in.
    scale_inv = amax.clamp(min=1e-12) / FP8_MAX
    q = (wf / _expand_scale(scale_inv, w.shape, (b0, b1))).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale_inv


def dequantize_fp8_block(
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: Sequence[int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Inverse of ``quantize_fp8_block``.

    Args:
        w_fp8: float8_e4m3fn ``[out, in]``.
        scale_inv: float32 ``[ceil(out/b0), ceil(in/b1)]``.
        block: ``(b0, b1)``.
        dtype: result dtype (the product is formed in float32 first).

    Returns:
        ``[out, in]`` tensor of ``dtype``.
    """
    expected = fp8_scale_shape(w_fp8.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match weight shape "
            f"{tuple(w_fp8.shape)} with block {tuple(block)}: expected {expected}"
        )
    w = w_fp8.to(torch.float32) * _expand_scale(scale_inv.to(torch.float32), w_fp8.shape, block)
    return w.to(dtype)


# --------------------------------------------------------------------------- reading


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, in index order (or the single file)."""
    d = Path(model_dir)
    index = d / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
        files = [d / n for n in names]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} in {d} names missing shards: {missing}")
        return files
    single = d / SINGLE_FILE
    if single.exists():
        return [single]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors checkpoint in {d}")
    return files


def checkpoint_tensor_names(model_dir: str | Path) -> list[str]:
    """Every tensor name of a checkpoint (headers only: no tensor is read)."""
    names: list[str] = []
    for f in checkpoint_files(model_dir):
        with safe_open(str(f), framework="pt", device="cpu") as h:
            names.extend(h.keys())
    return names


def checkpoint_block_size(model_dir: str | Path) -> tuple[int, int] | None:
    """``weight_block_size`` from config.json's fp8 ``quantization_config``, or None.

    Raises:
        ConfigError: a quantization_config we cannot read (unknown quant_method, ...).
    """
    path = Path(model_dir) / "config.json"
    if not path.exists():
        return None
    return parse_quantization_config(json.loads(path.read_text()))


def iter_checkpoint_tensors(
    model_dir: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    dequantize: bool | Callable[[str], bool] = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of a checkpoint, shard by shard.

    With ``dequantize`` (the default) each fp8 ``X.weight`` is yielded as the
    real weight (fp8 value x block scale) and its ``X.weight_scale_inv`` is
    not yielded; without it both are yielded as stored (for fp8 GEMMs). A
    callable decides per weight name (``dequantize("X.weight")``; its scale
    follows the same decision).
    Floating tensors are cast to ``dtype`` when given (dequantized weights
    default to bfloat16 otherwise); integer tensors keep their dtype.

    Raises:
        ConfigError: fp8 tensors without an fp8 quantization_config, or an
            unsupported quantization_config.
        ValueError: an fp8 weight without its scale, or a scale of the wrong shape.
    """
    files = checkpoint_files(model_dir)
    block = checkpoint_block_size(model_dir)
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt", device="cpu")) for f in files]
        where = {name: h for h in handles for name in h.keys()}
        wants = dequantize if callable(dequantize) else (lambda _name, d=bool(dequantize): d)
        for h in handles:
            for name in h.keys():
                if name.endswith(SCALE_SUFFIX) and wants(name[: -len(SCALE_SUFFIX)]):
                    continue
                t = h.get_tensor(name)
                if t.dtype == torch.float8_e4m3fn and wants(name):
                    if block is None:
                        raise ConfigError(
                            f"tensor {name!r} is float8_e4m3fn but config.json has no fp8 "
                            "quantization_config (quantization_config.weight_block_size is needed)"
                        )
                    scale_name = name + SCALE_SUFFIX
                    if scale_name not in where:
                        raise ValueError(f"fp8 tensor {name!r} has no {scale_name!r} in the checkpoint")
                    scale = where[scale_name].get_tensor(scale_name)
                    try:
                        t = dequantize_fp8_block(t, scale, block, dtype or torch.bfloat16)
                    except ValueError as e:
                        raise ValueError(f"{name}: {e}") from e
                elif (
                    dtype is not None
                    and t.is_floating_point()
                    and t.dtype != torch.float8_e4m3fn
                    and not name.endswith(SCALE_SUFFIX)  # scales stay float32 for fp8 GEMMs
                ):
                    t = t.to(dtype)
                yield name, t.to(device)


def load_checkpoint(
    model_dir: str | Path,
    dtype: torch.dtype | None = torch.bfloat16,
    device: str | torch.device = "cpu",
    dequantize: bool = True,
) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint as a dict (see ``iter_checkpoint_tensors``)."""
    return dict(iter_checkpoint_tensors(model_dir, dtype=dtype, device=device, dequantize=dequantize))


# --------------------------------------------------------------------------- writing fp8


def is_fp8_quantizable(name: str, tensor: torch.Tensor) -> bool:
    """Whether a checkpoint tensor is quantized in DeepSeek-style fp8 checkpoints.

    Those are the 2-D projection weights of attention (including the
    indexer's ``wq_b`` / ``wk``) and of dense, shared and routed experts.
    Norms, embeddings, lm_head, the MTP ``eh_proj`` / ``shared_head``, the
    router gate, ``e_score_correction_bias`` and the indexer's
    ``weights_proj`` stay in high precision.
    """
    if tensor.dim() != 2 or not tensor.is_floating_point() or tensor.dtype == torch.float8_e4m3fn:
        return False
    if not name.endswith(".weight"):
        return False
    if ".self_attn." not in name and ".mlp." not in name:
        return False
    if name.endswith(".mlp.gate.weight") or name.endswith("indexer.weights_proj.weight"):
        return False
    if "norm" in name.rsplit(".", 2)[-2]:
        return False
    return True


def write_fp8_checkpoint(
    src_dir: str | Path, dst_dir: str | Path, block: Sequence[int] = (128, 128)
) -> Path:
    """Copy a high-precision checkpoint to ``dst_dir`` with fp8 block-quantized projections.

    Every tensor selected by ``is_fp8_quantizable`` becomes float8_e4m3fn
    plus a float32 ``<name>_scale_inv`` stored next to it (same shard); other
    tensors are copied unchanged.  Shard names are kept and the index is
    rewritten; config.json gains an fp8 ``quantization_config`` with
    ``weight_block_size = block``.  Other files (tokenizer, generation
    config) are copied.  Returns ``dst_dir``.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    if src.resolve() == dst.resolve():
        raise ValueError("write_fp8_checkpoint needs distinct source and destination directories")
    if checkpoint_block_size(src) is not None:
        raise ValueError(f"{src} is already fp8-quantized")
    dst.mkdir(parents=True, exist_ok=True)
    files = checkpoint_files(src)
    weight_map: dict[str, str] = {}
    total = 0
    for f in files:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(f), framework="pt", device="cpu") as h:
            metadata = h.metadata()
            for name in h.keys():
                t = h.get_tensor(name)
                if is_fp8_quantizable(name, t):
                    q, s = quantize_fp8_block(t, block)
                    out[name], out[name + SCALE_SUFFIX] = q, s
                else:
                    out[name] = t
        for name, t in out.items():
            weight_map[name] = f.name
            total += t.numel() * t.element_size()
        save_file(out, str(dst / f.name), metadata=metadata)

    skip = {f.name for f in files} | {INDEX_FILE, "config.json"}
    for p in src.iterdir():
        if p.is_file() and p.name not in skip:
            shutil.copyfile(p, dst / p.name)

    if (src / INDEX_FILE).exists():
        index = json.loads((src / INDEX_FILE).read_text())
        index["metadata"] = {**index.get("metadata", {}), "total_size": total}
        index["weight_map"] = dict(sorted(weight_map.items()))
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {**FP8_QUANTIZATION_CONFIG, "weight_block_size": [int(block[0]), int(block[1])]}
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dst
