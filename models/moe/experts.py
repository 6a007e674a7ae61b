"""This rank's routed experts as stacked tensors (what grouped GEMMs read).

``w13 [E_local, 2 * I, H]``: expert ``e``'s ``gate_proj`` in rows ``[0, I)``
and ``up_proj`` in rows ``[I, 2 * I)``; ``w2 [E_local, H, I]``: its
``down_proj``. ``E_local`` experts of a contiguous range
``[first_expert, first_expert + E_local)`` (expert parallelism: rank ``r`` of
``n`` holds range ``r``).

The checkpoint stores one tensor per expert and projection
(``mlp.experts.{e}.{gate,up,down}_proj.weight``): the loader hands each to
``load_checkpoint_tensor``, which copies it into its slice of the stacked
tensor. Nothing else holds the experts' weights (no per-expert modules).

fp8 (``quant_block = (b0, b1)``): ``w13`` / ``w2`` are float8_e4m3fn and
``w13_scale_inv [E_local, 2I / b0, ceil(H / b1)]`` / ``w2_scale_inv
[E_local, ceil(H / b0), ceil(I / b1)]`` hold the checkpoint's
``weight_scale_inv`` blocks, stacked the same way (the layout DeepGEMM's
grouped fp8 GEMMs take). The loader keeps an fp8 checkpoint's experts in fp8
on the ``cuda`` backend (`to_fp8`) and dequantizes them for the ``reference``
backend; the reference grouped GEMM dequantizes one expert at a time when
given scales, the Triton one tile by tile in registers.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn as nn

_PROJ = ("gate_proj", "up_proj", "down_proj")
_NAME = re.compile(r"^(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")


class RoutedExperts(nn.Module):
    def __init__(self, hidden: int, intermediate: int, first_expert: int, num_local: int, dtype: torch.dtype,
                 quant_block: tuple[int, int] | None = None):
        super().__init__()
        self.hidden, self.intermediate = hidden, intermediate
        self.first_expert, self.num_local = first_expert, num_local
        self.w13 = nn.Parameter(torch.empty(num_local, 2 * intermediate, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_local, hidden, intermediate, dtype=dtype), requires_grad=False)
        self.w13_scale_inv = self.w2_scale_inv = None
        self.quant_block = None
        if quant_block is not None:
            self.to_fp8(tuple(quant_block))
        self._loaded: set[str] = set()

    def to_fp8(self, block: tuple[int, int]) -> None:
        """Hold the experts as fp8 with block scales (on the weights' device, normally meta, before loading)."""
        b0, b1 = block
        if self.intermediate % b0:
            # gate and up share no scale block only if I is a multiple of the block rows.
            raise ValueError(f"moe_intermediate_size={self.intermediate} is not a multiple of the fp8 block {b0}")
        E, H, I, dev = self.num_local, self.hidden, self.intermediate, self.w13.device
        fp8 = torch.float8_e4m3fn
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, H, dtype=fp8, device=dev), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, H, I, dtype=fp8, device=dev), requires_grad=False)
        self.w13_scale_inv = nn.Parameter(
            torch.empty(E, 2 * I // b0, math.ceil(H / b1), dtype=torch.float32, device=dev), requires_grad=False)
        self.w2_scale_inv = nn.Parameter(
            torch.empty(E, math.ceil(H / b0), math.ceil(I / b1), dtype=torch.float32, device=dev),
            requires_grad=False)
        self.quant_block = (b0, b1)

    def extra_repr(self) -> str:
        return (f"experts [{self.first_expert}, {self.first_expert + self.num_local}), hidden={self.hidden}, "
                f"intermediate={self.intermediate}, quant_block={self.quant_block}")

    def owns(self, expert: int) -> bool:
        return self.first_expert <= expert < self.first_expert + self.num_local

    def _slice(self, proj: str, kind: str, local: int) -> torch.Tensor:
        """The slice of a stacked tensor that holds ``proj``'s ``kind`` of local expert ``local``."""
        if kind == "weight":
            w13, w2, rows = self.w13, self.w2, self.intermediate
        else:
            w13, w2, rows = self.w13_scale_inv, self.w2_scale_inv, self.intermediate // self.quant_block[0]
        if proj == "gate_proj":
            return w13.data[local, :rows]
        if proj == "up_proj":
            return w13.data[local, rows:]
        return w2.data[local]

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy checkpoint tensor ``{e}.{proj}.weight[_scale_inv]`` (relative to this module) into place.

        Returns False for a tensor that is not this rank's (another rank's
        expert, a scale without fp8 weights here, an unknown name).
        Raises ValueError for a tensor of the wrong shape."""
        m = _NAME.match(name)
        if m is None:
            return False
        expert, proj, kind = int(m.group(1)), m.group(2), m.group(3)
        if not self.owns(expert) or (kind == "weight_scale_inv" and self.quant_block is None):
            return False
        dst = self._slice(proj, kind, expert - self.first_expert)
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ValueError(f"expert {expert} {proj}.{kind}: checkpoint shape {tuple(tensor.shape)} "
                             f"!= model shape {tuple(dst.shape)}")
        dst.copy_(tensor.to(dst.dtype))
        self._loaded.add(name)
        return True

    def missing_checkpoint_tensors(self) -> list[str]:
        """Names (relative to this module) of this rank's tensors not loaded yet."""
        kinds = ("weight", "weight_scale_inv") if self.quant_block else ("weight",)
        want = [f"{e}.{p}.{k}" for e in range(self.first_expert, self.first_expert + self.num_local)
                for p in _PROJ for k in kinds]
        return [n for n in want if n not in self._loaded]
