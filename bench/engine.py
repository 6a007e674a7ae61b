#!/usr/bin/env python
"""Decode-step cost of the engine's target forward on the cuda backend (issue 5).

A DeepSeek-V3.2-shaped model with random weights: the real attention and
indexer dims (hidden 7168, 128 heads, q_lora 1536, latent 512 + rope 64,
indexer 64 x 128, top-k 2048), ``--layers`` layers (the first dense, as
``first_k_dense_replace = 1``), ``--experts`` routed experts of 2048 (8 per
token, one shared), vocab 129,280, bf16 weights, fp8 caches filled with
quantized random keys. ``--batch`` requests with contexts uniform in
[context/2, 3*context/2], pages scattered over the pool.

For every batch size and width (1 = plain decode, ``--next-n`` = an MTP
verify step) it prints, all measured in this run:

* ``graph ms``: one replay of the captured CUDA graph of the step
  (``workers.decode_graphs``), median of ``triton.testing.do_bench``;
* ``eager ms``: the same static-buffer forward run eagerly (launch-bound);
* ``kernel sum ms``: the summed durations of the GPU kernels (and memsets /
  copies) of one step, from ``torch.profiler`` over the eager run;
* ``graph / kernel sum`` (issue 5 target: <= 1.2) and, per batch size, the
  verify step over the plain step (target at batch 32: <= 1.3);
* ``roofline ms``: the bytes the step must read once over the GPU's HBM bandwidth
  (`bench/roofline.py`), and ``graph / roofline`` (issue 18 target: <= 1.3).

``--fp8`` holds the projections and experts in fp8 (128 x 128 block scales).

The forward ends at the final norm: the lm_head GEMM and sampling run after
the graph (``Engine._decode``). ``python bench/engine.py [--batch 32 128]
[--context 4096] [--next-n 2] [--json out.json]``; needs a GPU with flash_mla
and deep_gemm.
"""

from __future__ import annotations

import os
import sys

_BENCH = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_BENCH)
sys.path[:] = [_ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != _BENCH]

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
from importlib import metadata  # noqa: E402

import torch  # noqa: E402

from attention.formats import PAGE_SIZE  # noqa: E402
from bench.cuda_profile import profile_calls  # noqa: E402
from bench.roofline import decode_step_bytes, hbm_bytes_per_s  # noqa: E402

def versions() -> dict:
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for pkg in ("triton", "sgl-deep-gemm", "sgl-flash-mla"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def build_model(layers: int, experts: int, fp8: bool = False):
    """A random-weight DeepSeek-V3.2-shaped ``DsaForCausalLM`` on the GPU (no checkpoint written);
    ``fp8``: the projections a DeepSeek fp8 checkpoint quantizes held in fp8 with 128 x 128 block
    scales (`models.fp8`), as the cuda backend holds a real fp8 checkpoint."""
    from models import fp8 as fp8_modules
    from models.config import load_config
    from models.model import DsaForCausalLM
    from bench.peers.checkpoint import dsv32_shaped_kwargs
    from models.tiny import _config_class, tiny_config_kwargs

    kwargs = tiny_config_kwargs("deepseek_v32", **dsv32_shaped_kwargs(layers, experts))
    with tempfile.TemporaryDirectory() as tmp:
        _config_class("deepseek_v32")(**kwargs).save_pretrained(tmp)
        cfg = load_config(tmp)
    with torch.device("meta"):
        model = DsaForCausalLM(cfg, dtype=torch.bfloat16, hadamard=True)
        if fp8:
            fp8_modules.to_fp8(model, fp8_modules.planned_fp8_modules(model, (128, 128)), (128, 128))
    model = model.to_empty(device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_scale_inv"):
                p.fill_(0.02)  # fp8 codes ~N(0, 1) times 0.02: the bf16 weights' scale
            elif p.dtype == torch.float8_e4m3fn:
                p.copy_(torch.randn(p.shape, device="cuda", generator=gen).to(torch.float8_e4m3fn))
            elif p.dim() == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    return model.eval()


def fill_cache(cache, backend, gen) -> None:
    """Quantize random latents / indexer keys into every slot of every layer."""
    spec = cache.spec
    step = 1 << 16
    for layer in range(spec.num_layers):
        for s0 in range(0, spec.num_slots, step):
            slots = torch.arange(s0, min(s0 + step, spec.num_slots), device="cuda")
            n = slots.numel()
            latent = torch.randn(n, spec.kv_lora_rank, device="cuda", generator=gen, dtype=torch.bfloat16)
            rope = torch.randn(n, spec.rope_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
            backend.write_mla(cache, layer, slots, latent, rope)
            if spec.indexer_layers[layer]:
                k = torch.randn(n, spec.index_head_dim, device="cuda", generator=gen)
                backend.write_index(cache, layer, slots, k)


def kernel_ms(fn, iters: int = 5) -> float:
    """Summed GPU activity (kernels, memsets, copies) of one ``fn()`` call, in ms."""
    from torch.autograd import DeviceType

    prof = profile_calls(fn, iters)
    us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return us / iters / 1000.0


def main() -> None:
    import triton

    from attention.backend import get_backend
    from attention.cache import PagedKVCache
    from workers.decode_graphs import DecodeGraphPlan, DecodeGraphs
    from workers.rank_build import RankSpec

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--next-n", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--fp8", action="store_true", help="fp8 block-quantized projections and experts")
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()

    info = versions()
    print("versions:", json.dumps(info))
    backend = get_backend("cuda")
    model = build_model(args.layers, args.experts, args.fp8)
    bandwidth = hbm_bytes_per_s(info["gpu"])
    max_ctx = args.context * 3 // 2 + args.next_n
    pages_per_req = -(-max_ctx // PAGE_SIZE)
    num_pages = max(args.batch) * pages_per_req + 1
    # The geometry a served rank allocates (RankSpec.cache_spec); the model itself is built here, not loaded.
    spec = RankSpec("", dtype="bfloat16", kv_cache_dtype="fp8", num_pages=num_pages, with_mtp=len(model.mtp) > 0)
    cache = PagedKVCache(spec.cache_spec(model.cfg), "cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    fill_cache(cache, backend, gen)
    hg = torch.Generator().manual_seed(2)
    print(f"model: {args.layers} layers, {args.experts} experts, "
          f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params; pool {num_pages} pages")

    rows = []
    for B in args.batch:
        perm = torch.randperm(num_pages - 1, generator=hg)[: B * pages_per_req] + 1
        page_tables = perm.view(B, pages_per_req).tolist()
        ctx = torch.randint(args.context // 2, args.context * 3 // 2 + 1, (B,), generator=hg).tolist()
        for width in sorted({1, args.next_n}):
            # One decode step: request b's ``width`` new tokens end at context ctx[b].
            step_args = ([str(b) for b in range(B)], torch.randint(2, 1000, (B * width,), generator=hg).tolist(),
                         ctx, page_tables)
            plan = DecodeGraphPlan(width, (B,), pages_per_req)
            graphs = DecodeGraphs(model, cache, backend, plan, "cuda", capture=True)
            graphs.capture_all()
            graphs.inputs.write_step(graphs.inputs.assign(step_args[0], page_tables), step_args[1], ctx)
            g = graphs.graphs[(B, pages_per_req)]
            graph_ms = float(triton.testing.do_bench(g.replay, warmup=10, rep=300, return_mode="median"))
            eager = DecodeGraphs(model, cache, backend, plan, "cuda", capture=False)
            eager.inputs.write_step(eager.inputs.assign(step_args[0], page_tables), step_args[1], ctx)
            batch = eager.inputs.batch(B)

            def step():
                with torch.inference_mode():
                    model(batch, cache, backend)

            eager_ms = float(triton.testing.do_bench(step, warmup=3, rep=300, return_mode="median"))
            ksum = kernel_ms(step)
            with torch.inference_mode():
                same = torch.equal(eager.run(*step_args), graphs.run(*step_args))
            floor = decode_step_bytes(model, B * width, ctx, width, cache.spec)
            roofline_ms = floor.total / bandwidth * 1000
            row = {"batch": B, "width": width, "mean_context": sum(ctx) / B, "graph_ms": graph_ms,
                   "roofline_ms": roofline_ms, "graph_over_roofline": graph_ms / roofline_ms,
                   "bytes": {"dense_weights": floor.dense_weights, "routed_experts": floor.routed_experts,
                             "kv_cache": floor.kv_cache},
                   "eager_ms": eager_ms, "kernel_sum_ms": ksum, "graph_over_kernels": graph_ms / ksum,
                   "eager_over_kernels": eager_ms / ksum, "replay_equals_eager": same,
                   "tokens_per_s": B * width / graph_ms * 1000}
            rows.append(row)
            print(json.dumps(row))
            del graphs, eager, g
            torch.cuda.empty_cache()

    print(f"\nweights: {'fp8' if args.fp8 else 'bf16'}; HBM {bandwidth / 1e12:.2f} TB/s (bench/roofline.py)")
    print("| batch | width | graph ms | roofline ms | graph / roofline | eager ms | kernel sum ms | graph / kernels "
          "| replay == eager |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['width']} | {r['graph_ms']:.3f} | {r['roofline_ms']:.3f} | "
              f"**{r['graph_over_roofline']:.2f}** | {r['eager_ms']:.3f} | {r['kernel_sum_ms']:.3f} | "
              f"{r['graph_over_kernels']:.2f} | {r['replay_equals_eager']} |")
    by = {(r["batch"], r["width"]): r for r in rows}
    for B in args.batch:
        if (B, 1) in by and (B, args.next_n) in by and args.next_n != 1:
            ratio = by[(B, args.next_n)]["graph_ms"] / by[(B, 1)]["graph_ms"]
            print(f"verify next_n={args.next_n} / plain decode at batch {B}: **{ratio:.2f}**")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": info, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
