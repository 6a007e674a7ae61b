"""Build a ``DsaForCausalLM`` from a Hugging Face checkpoint directory.

Checkpoint tensor names map one to one onto module names, with two renames:
``model.`` is dropped, and checkpoint layer ``num_hidden_layers + d`` (the MTP
block) becomes ``mtp.d`` (its decoder weights under ``mtp.d.decoder``).
Tensor-parallel shards are sliced here, on load, from the full tensors.
A module with ``load_checkpoint_tensor`` places the tensors under its name
itself (the routed experts: ``experts.{e}.gate_proj.weight`` is a slice of the
stacked ``experts.w13``) and reports what it still lacks.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from models import fp8
from models.config import ModelConfig, load_config
from models.model import DsaForCausalLM
from models.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TPContext
from models.weights import iter_checkpoint_tensors

log = logging.getLogger(__name__)

_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "embed_tokens.", "shared_head.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def module_name(ckpt_name: str, cfg: ModelConfig) -> str | None:
    """Module parameter name for a checkpoint tensor name; ``None`` = not ours."""
    m = _LAYER.match(ckpt_name)
    if m:
        layer, rest = int(m.group(1)), m.group(2)
        if layer < cfg.num_hidden_layers:
            return f"layers.{layer}.{rest}"
        depth = layer - cfg.num_hidden_layers
        if depth >= cfg.num_nextn_predict_layers:
            return None
        return f"mtp.{depth}.{rest}" if rest.startswith(_MTP_OWN) else f"mtp.{depth}.decoder.{rest}"
    if ckpt_name.startswith("model."):
        return ckpt_name[len("model."):]
    return ckpt_name


def _placer_of(name: str, placers: dict) -> tuple[str, object] | None:
    """The module of ``placers`` whose name is the longest prefix of parameter path ``name``."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in placers:
            return prefix, placers[prefix]
    return None


def shard_tensor(module, tensor: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """This rank's slice of a full checkpoint tensor of ``module``.

    Column-parallel weights ``[out, in]`` and biases ``[out]`` are split along
    ``out`` (rows ``[rank * n, (rank + 1) * n)``); row-parallel weights along
    ``in``, their bias ``[out]`` stays whole (added once after the reduction).
    Everything else (replicated projections, norms, whole experts) is whole.
    """
    if tp.size == 1 or not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        return tensor
    if tensor.dim() == 2:
        dim = module.shard_dim
    elif tensor.dim() == 1 and isinstance(module, ColumnParallelLinear):
        dim = 0
    else:
        return tensor
    n = tensor.shape[dim] // tp.size
    return tensor.narrow(dim, tp.rank * n, n)


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
               tp: TPContext = SINGLE, hadamard: bool = False, with_mtp: bool = True,
               fp8_weights: bool = False) -> DsaForCausalLM:
    """Load config and weights. Raises ``ValueError`` naming every missing tensor
    (a layer that computes top-k without indexer weights is an error, never a
    silent fallback).

    ``fp8_weights`` (the ``cuda`` backend): the projections an fp8 checkpoint stores
    block-quantized stay fp8 (`models.fp8`); otherwise, and for a bf16 checkpoint,
    every weight is held in ``dtype``."""
    cfg = load_config(model_dir)
    with torch.device("meta"):
        model = DsaForCausalLM(cfg, dtype=dtype, tp=tp, hadamard=hadamard, with_mtp=with_mtp)
    name_of = lambda name: module_name(name, cfg)  # noqa: E731
    dequantize: bool | object = True
    if fp8_weights and cfg.weight_block_size is not None:
        fp8_names = fp8.checkpoint_fp8_modules(model, model_dir, name_of, cfg.weight_block_size)
        fp8.to_fp8(model, fp8_names, cfg.weight_block_size)
        dequantize = lambda ckpt: _owner_not_fp8(name_of(ckpt), fp8_names)  # noqa: E731
    return load_weights(model, model_dir, name_of, device=device, tp=tp,
                        read_dtype=dtype, tie_word_embeddings=cfg.tie_word_embeddings, dequantize=dequantize)


def _owner_not_fp8(param: str | None, fp8_names: set[str]) -> bool:
    """Whether the weight ``param`` (a parameter name) belongs to no fp8 module: dequantize it on load."""
    return param is None or not any(param.startswith(n + ".") for n in fp8_names)


def load_weights(model: torch.nn.Module, model_dir: str | Path, name_of, device: str = "cpu",
                 tp: TPContext = SINGLE, read_dtype: torch.dtype | None = None,
                 tie_word_embeddings: bool = False, tied: tuple[str, str] = ("lm_head.weight", "embed_tokens.weight"),
                 dequantize=True) -> torch.nn.Module:
    """Fill a model built on the meta device with a checkpoint's tensors (any architecture).

    ``name_of(checkpoint_name)`` gives the parameter name (``None``: not ours);
    tensors are read as ``read_dtype`` (fp8 ones dequantized to it) and copied
    into each parameter's own dtype; tensor-parallel shards are sliced here.
    ``dequantize``: as `iter_checkpoint_tensors` takes it (fp8 modules read their
    weights and scales as stored).
    ``tied = (head, embedding)``: with ``tie_word_embeddings`` a head the
    checkpoint lacks is copied from the embedding. Returns the model in eval
    mode. Raises ``ValueError`` naming every parameter left unloaded."""
    model = model.to_empty(device=device)
    # Weights were built on the meta device (no memory for a 671B model);
    # derived buffers (RoPE frequencies, Hadamard matrices) are recomputed.
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    # Modules that place checkpoint tensors themselves (stacked routed experts:
    # one checkpoint tensor per expert and projection fills a slice of one parameter).
    placers = {n: m for n, m in modules.items() if hasattr(m, "load_checkpoint_tensor")}
    loaded: set[str] = set()
    for ckpt_name, tensor in iter_checkpoint_tensors(model_dir, dtype=read_dtype, dequantize=dequantize):
        name = name_of(ckpt_name)
        if name is not None and name not in params:
            placer = _placer_of(name, placers)
            if placer is not None:
                prefix, module = placer
                try:
                    if not module.load_checkpoint_tensor(name[len(prefix) + 1:], tensor):
                        log.debug("checkpoint tensor %s is not this rank's; skipped", ckpt_name)
                except ValueError as e:
                    raise ValueError(f"{ckpt_name}: {e}") from e
                continue
        if name is None or name not in params:
            log.debug("checkpoint tensor %s has no module here; skipped", ckpt_name)
            continue
        owner = modules[name.rsplit(".", 1)[0]]
        tensor = shard_tensor(owner, tensor, tp)
        p = params[name]
        if tuple(tensor.shape) != tuple(p.shape):
            raise ValueError(f"{ckpt_name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(p.shape)}")
        p.data.copy_(tensor.to(p.dtype))
        loaded.add(name)
    head, embedding = tied
    if tie_word_embeddings and head in params and head not in loaded:
        params[head].data.copy_(params[embedding].data)
        loaded.add(head)
    placed = tuple(prefix + "." for prefix in placers)
    missing = sorted({n for n in params if not n.startswith(placed)} - loaded)
    missing += [f"{prefix}.{n}" for prefix, m in placers.items() for n in m.missing_checkpoint_tensors()]
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {shown}")
    model.eval()
    return model
