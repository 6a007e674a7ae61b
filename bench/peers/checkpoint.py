"""DeepSeek-V3.2-shaped random checkpoints in the real Hugging Face format, for the peer comparison.

Real per-layer dims (hidden 7168, 128 heads, MLA latent 512 + rope 64, q_lora 1536, the
indexer's 64 heads x 128, experts of 2048, top-8 routing, YaRN RoPE, vocab 129,280) with
fewer layers and experts, made through transformers' own ``DeepseekV32ForCausalLM`` (so
every tensor name and shape is the release's), optionally with the MTP layer, in bf16 or
fp8 block-quantized (128x128 ``weight_scale_inv`` and a ``quantization_config`` like the
release's), so both engines run their fp8 paths. The tokenizer is the tiny models'
byte-level one (ids 0-260); benchmarks send token ids.

    python -m bench.peers.checkpoint /tmp/dsv32-4l --layers 4 --experts 16 [--fp8] [--mtp]

At 4 layers and 16 experts the bf16 checkpoint is ~10.6 GB (~70 s on the GPU host's
CPU): make it there, never ship it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

# The attention, indexer and MoE dims of DeepSeek-V3.2 (its config.json), layers and
# experts aside; bench/engine.py builds its in-memory model from the same table.
DSV32_SHAPES = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_shared_experts=1,
    num_experts_per_tok=8, first_k_dense_replace=1, index_n_heads=64, index_head_dim=128,
    index_topk=2048, max_position_embeddings=163840, num_nextn_predict_layers=0,
    # Routing fields of the release's config.json that transformers' class drops but other
    # engines read (vLLM creates the router's e_score_correction_bias only for noaux_tc).
    topk_method="noaux_tc", scoring_func="sigmoid", routed_scaling_factor=2.5, norm_topk_prob=True,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1.0, "mscale_all_dim": 1.0},
)


def dsv32_shaped_kwargs(layers: int, experts: int, mtp: bool = False, **overrides) -> dict:
    """transformers ``DeepseekV32Config`` keyword arguments: DeepSeek-V3.2's dims with
    ``layers`` decoder layers (the first dense) and ``experts`` routed experts (8 groups, top-4
    groups when ``experts`` divides by 8, as the release routes)."""
    if layers < 2:
        raise ValueError(f"--layers must be >= 2 (the first layer is dense), got {layers}")
    if experts < DSV32_SHAPES["num_experts_per_tok"]:
        raise ValueError(f"--experts must be >= {DSV32_SHAPES['num_experts_per_tok']} (top-8 routing), got {experts}")
    n_group = 8 if experts % 8 == 0 else 1
    return {**DSV32_SHAPES, "num_hidden_layers": layers, "n_routed_experts": experts, "n_group": n_group,
            "topk_group": min(4, n_group), "num_nextn_predict_layers": int(mtp), **overrides}


def make_checkpoint(out_dir: str | Path, layers: int = 4, experts: int = 16, *, fp8: bool = False,
                    mtp: bool = False, seed: int = 0, **overrides) -> Path:
    """Write the checkpoint to ``out_dir`` (config.json, safetensors, tokenizer); returns it.
    ``overrides``: any config field (e.g. smaller dims for a CPU test)."""
    from models.tiny import make_tiny

    kwargs = dsv32_shaped_kwargs(layers, experts, mtp, **overrides)
    # Built on the CPU: its seeded generators are CPU ones, so the weights
    # are the same on every host (a CUDA default device made them fail).
    return make_tiny("deepseek_v32", out_dir, seed=seed, fp8=fp8, **kwargs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--fp8", action="store_true", help="block-quantized fp8 projections (128x128 weight_scale_inv)")
    ap.add_argument("--mtp", action="store_true", help="with the MTP (next-n) layer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--from-bf16", default=None, metavar="DIR",
                    help="quantize this bf16 checkpoint instead of building one (--fp8 implied; the same weights)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.from_bf16:
        from models.weights import write_fp8_checkpoint

        out = write_fp8_checkpoint(args.from_bf16, args.out_dir)
    else:
        out = make_checkpoint(args.out_dir, args.layers, args.experts, fp8=args.fp8, mtp=args.mtp, seed=args.seed)
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    print(json.dumps({"checkpoint": str(out), "bytes": size, "seconds": round(time.perf_counter() - t0, 1),
                      "layers": cfg["num_hidden_layers"], "experts": cfg["n_routed_experts"],
                      "mtp": cfg.get("num_nextn_predict_layers", 0),
                      "quantization_config": cfg.get("quantization_config")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
