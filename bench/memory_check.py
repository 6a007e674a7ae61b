#!/usr/bin/env python
"""Does `dsa-pd check`'s memory plan equal what loading allocates? (issue 18, on the GPU)

Writes a DeepSeek-V3.2 fp8 checkpoint at the real dims (256 experts of 2048, hidden 7168, ...)
truncated to ``--layers`` layers, straight from random tensors made on the GPU (the tensor names
and shapes of the release: ``model.layers.N...``, one tensor per expert and projection, 128 x 128
``weight_scale_inv`` on the projections DeepSeek quantizes), then builds a cuda-backend rank of it
(`workers.rank_build.build_rank`: weights kept fp8, fp8 page pool) and compares
``torch.cuda.memory_allocated()`` with the controller's plan (`deployments.controller`:
``weight_bytes_per_rank``, i.e. `models.footprint.weight_bytes`, + pages x ``bytes_per_page``). Prints both, their ratio and the load time.

``python bench/memory_check.py DIR --layers 4 [--experts 256] [--num-pages 2048] [--write [--write-only] [--bf16]]``
(``--write-only``: a fast maker of real-dims checkpoints for the benches, fp8 or ``--bf16``).
"""

from __future__ import annotations

import os
import sys

_BENCH = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_BENCH)
sys.path[:] = [_ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != _BENCH]

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

SHARD_BYTES = 4 << 30


def checkpoint_tensors(cfg):
    """``(checkpoint name, shape)`` of every tensor of the release's format for ``cfg`` (no MTP layer)."""
    from models.model import DsaForCausalLM

    with torch.device("meta"):
        model = DsaForCausalLM(cfg, dtype=torch.bfloat16, with_mtp=False)
    for name, p in model.named_parameters():
        if name.endswith("experts.w13") or name.endswith("experts.w2"):
            prefix = "model." + name.rsplit(".", 1)[0]
            E, rows, cols = p.shape
            for e in range(E):
                if name.endswith("w13"):
                    yield f"{prefix}.{e}.gate_proj.weight", (rows // 2, cols)
                    yield f"{prefix}.{e}.up_proj.weight", (rows // 2, cols)
                else:
                    yield f"{prefix}.{e}.down_proj.weight", (rows, cols)
        else:
            yield (name if name.startswith("lm_head") else "model." + name), tuple(p.shape)


def write_checkpoint(out: Path, layers: int, experts: int, fp8: bool = True) -> None:
    """The checkpoint in the release's format (``fp8=False``: every projection bf16, no quantization_config)."""
    from safetensors.torch import save_file

    from bench.peers.checkpoint import dsv32_shaped_kwargs
    from models.config import load_config
    from models.tiny import _config_class, tiny_config_kwargs
    from models.weights import FP8_QUANTIZATION_CONFIG, is_fp8_quantizable, quantize_fp8_block

    out.mkdir(parents=True, exist_ok=True)
    _config_class("deepseek_v32")(**tiny_config_kwargs("deepseek_v32", **dsv32_shaped_kwargs(layers, experts))) \
        .save_pretrained(out)
    if fp8:
        raw = json.loads((out / "config.json").read_text())
        raw["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
        (out / "config.json").write_text(json.dumps(raw, indent=1))
    cfg = load_config(out)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shard, size, index, n = {}, 0, {}, 0

    def flush():
        nonlocal shard, size, n
        if shard:
            fname = f"model-{n:05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            index.update({k: fname for k in shard})
            shard, size, n = {}, 0, n + 1

    for name, shape in checkpoint_tensors(cfg):
        probe = torch.empty(shape, device="meta", dtype=torch.bfloat16)
        if "norm" in name.rsplit(".", 2)[-2]:
            tensors = {name: torch.ones(shape, dtype=torch.bfloat16)}
        elif len(shape) == 1:
            tensors = {name: torch.zeros(shape, dtype=torch.float32)}
        else:
            w = torch.randn(shape, device="cuda", generator=gen) * shape[-1] ** -0.5
            if fp8 and is_fp8_quantizable(name, probe):
                q, s = quantize_fp8_block(w, (128, 128))
                tensors = {name: q.cpu(), name + "_scale_inv": s.cpu()}
            else:
                tensors = {name: w.to(torch.bfloat16).cpu()}
        for k, t in tensors.items():
            shard[k] = t
            size += t.numel() * t.element_size()
        if size >= SHARD_BYTES:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))


def main() -> None:
    from models.config import load_config
    from models.footprint import weight_bytes
    from workers.rank_build import RankSpec, build_rank

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--num-pages", type=int, default=2048)
    ap.add_argument("--write", action="store_true", help="write the checkpoint first")
    ap.add_argument("--bf16", action="store_true", help="write (and plan) a bf16 checkpoint instead")
    ap.add_argument("--write-only", action="store_true", help="write the checkpoint, measure nothing")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = Path(args.dir)
    if args.write:
        t = time.perf_counter()
        write_checkpoint(out, args.layers, args.experts, fp8=not args.bf16)
        print(f"checkpoint written in {time.perf_counter() - t:.1f} s: "
              f"{sum(f.stat().st_size for f in out.glob('*.safetensors')) / 2**30:.2f} GiB")
        if args.write_only:
            return
    cfg = load_config(out)
    spec = RankSpec(str(out), "cuda", "cuda", "bfloat16", "fp8", num_pages=args.num_pages, with_mtp=False)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    t = time.perf_counter()
    rank = build_rank(spec)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t
    allocated = torch.cuda.memory_allocated() - before
    # What `dsa-pd check` prints (deployments.controller.weight_bytes_per_rank calls this; the GPU host
    # lacks pydantic, so the controller itself is not imported here).
    weights = weight_bytes(cfg, 1, torch.bfloat16, spec.fp8_weights, with_mtp=False, hadamard=spec.use_hadamard)
    pages = args.num_pages * spec.cache_spec(cfg).page_bytes()
    loaded_weights = sum(t.numel() * t.element_size() for t in list(rank.model.parameters()) + list(rank.model.buffers()))
    row = {"gpu": torch.cuda.get_device_name(), "layers": args.layers, "experts": args.experts,
           "planned_weights_gib": weights / 2**30, "planned_pages_gib": pages / 2**30,
           "planned_gib": (weights + pages) / 2**30, "allocated_gib": allocated / 2**30,
           "allocated_over_planned": allocated / (weights + pages), "loaded_param_bytes_equal_plan": loaded_weights == weights,
           "load_s": load_s}
    print(json.dumps(row))
    print(f"plan {row['planned_gib']:.2f} GiB (weights {row['planned_weights_gib']:.2f} + pages "
          f"{row['planned_pages_gib']:.2f}); memory_allocated {row['allocated_gib']:.2f} GiB: "
          f"**{row['allocated_over_planned']:.4f}x**; loaded in {load_s:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
