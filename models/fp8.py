"""Which modules of a model hold fp8 block-quantized weights, and turning them fp8.

An fp8 checkpoint (DeepSeek-V3.2 / GLM-5-FP8 style, `models.weights`) stores a
projection as float8_e4m3fn ``X.weight`` plus float32 ``X.weight_scale_inv``.
On the ``cuda`` backend such a projection stays fp8 in memory (`to_fp8`) and runs
the fp8 kernels of `models.ops`; the ``reference`` backend dequantizes on load.

Two ways to name the fp8 modules, which agree on checkpoints written the
DeepSeek way (`models.weights.is_fp8_quantizable`, what `write_fp8_checkpoint`
and real releases quantize):

* `checkpoint_fp8_modules`: the modules owning a ``weight_scale_inv`` in the
  checkpoint (what loading does: the checkpoint is the truth);
* `planned_fp8_modules`: the modules the naming rule quantizes (what the memory
  plan counts, from the config alone: `weight_bytes`).

A module that reads its own weight outside a GEMM (``fp8_ok = False``: MLA's
absorbed ``kv_b_proj``) is never fp8; the loader dequantizes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch.nn as nn

from models.moe.experts import RoutedExperts
from models.parallel import ReplicatedLinear
from models.weights import SCALE_SUFFIX, checkpoint_tensor_names, is_fp8_quantizable


def fp8_capable(model: nn.Module, block: tuple[int, int]) -> dict[str, nn.Module]:
    """``{module name: module}`` of the modules that can hold fp8 weights of ``block``.

    Routed experts whose intermediate size is not a multiple of the block's rows cannot: gate and
    up are stacked in one ``w13`` whose scale rows would straddle the two (tiny test models only;
    DeepSeek-V3.2 and GLM-5 have 2048-wide experts and 128-row blocks)."""
    return {n: m for n, m in model.named_modules()
            if (isinstance(m, ReplicatedLinear) and m.fp8_ok)
            or (isinstance(m, RoutedExperts) and m.intermediate % block[0] == 0)}


def _owner(param_name: str, names: Iterable[str]) -> str | None:
    """The longest module name in ``names`` that is a prefix of ``param_name`` (dot-separated)."""
    best = None
    for n in names:
        if param_name.startswith(n + ".") and (best is None or len(n) > len(best)):
            best = n
    return best


def checkpoint_fp8_modules(model: nn.Module, model_dir: str | Path, name_of: Callable[[str], str | None],
                           block: tuple[int, int]) -> set[str]:
    """Modules of ``model`` whose checkpoint weights carry a ``weight_scale_inv`` (``name_of``: checkpoint
    name -> parameter name, ``None`` = not ours)."""
    capable = fp8_capable(model, block)
    found = set()
    for ckpt in checkpoint_tensor_names(model_dir):
        if not ckpt.endswith(SCALE_SUFFIX):
            continue
        param = name_of(ckpt[: -len(SCALE_SUFFIX)])
        owner = _owner(param, capable) if param is not None else None
        if owner is not None:
            found.add(owner)
    return found


def planned_fp8_modules(model: nn.Module, block: tuple[int, int]) -> set[str]:
    """Modules of ``model`` that the DeepSeek naming rule quantizes (module names follow checkpoint names)."""
    found = set()
    for name, m in fp8_capable(model, block).items():
        probe = m.w13[0] if isinstance(m, RoutedExperts) else m.weight
        if is_fp8_quantizable(f"{name}.0.gate_proj.weight" if isinstance(m, RoutedExperts) else f"{name}.weight",
                              probe):
            found.add(name)
    return found


def to_fp8(model: nn.Module, names: Iterable[str], block: tuple[int, int]) -> None:
    """Turn the named modules' weights into fp8 + block scales (on the meta device before loading)."""
    capable = fp8_capable(model, block)
    names = set(names)
    for name in [n for n in capable if n in names]:  # model order: the first misfit is named
        try:
            capable[name].to_fp8(tuple(block))
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (what the model occupies once loaded)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)

