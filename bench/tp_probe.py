"""Tensor parallel 2 on two GPUs, phase by phase, for finding where a run stops: builds the tiny
serving-dims model's tp 2 `LLM` (rank graphs, or eager with two-batch overlap) and generates, printing
each phase's time; with ``--stacks-after S`` every process (the driver and, through
``DSA_PD_RANK_STACKS_S``, each rank worker) prints its Python stacks every S seconds.

    python -m bench.tp_probe --mode graphs|tbo|eager [--stacks-after 60]
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import tempfile
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tp_probe")
    p.add_argument("--mode", choices=["graphs", "tbo", "eager"], default="graphs")
    p.add_argument("--stacks-after", type=float, default=0.0)
    args = p.parse_args(argv)
    import ray
    import torch

    from models.tiny import make_tiny
    from workers.offline import LLM

    env = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL_", "DSA_PD_"))}
    if args.stacks_after:
        env["DSA_PD_RANK_STACKS_S"] = str(args.stacks_after)
        faulthandler.dump_traceback_later(args.stacks_after, repeat=True, file=sys.stderr)
    ray.init(num_gpus=torch.cuda.device_count(), include_dashboard=False, runtime_env={"env_vars": env})
    t0 = time.perf_counter()

    def say(what: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f} s] {args.mode}: {what}", flush=True)

    model = make_tiny("deepseek_v32", tempfile.mkdtemp() + "/m", seed=5, kv_lora_rank=512, qk_rope_head_dim=64,
                      index_head_dim=128, index_n_heads=64, num_attention_heads=16, index_topk=64)
    kw = dict(backend="cuda", device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", num_pages=128, chunk_size=64,
              tp_size=2)
    extra = {"graphs": dict(cuda_graphs=True), "tbo": dict(cuda_graphs=False, two_batch_overlap=True),
             "eager": dict(cuda_graphs=False)}[args.mode]
    say(f"env {env}; building")
    llm = LLM(model, **kw, **extra)
    say("built (ranks started, prefill warmed, graphs captured where asked)")
    prompts = [[40 + (i * 7 + j * 13) % 80 for j in range(n)] for i, n in enumerate((5, 70, 150, 260))]
    out = llm.generate(prompts[:1], max_new_tokens=4, ignore_eos=True)
    say(f"one prompt: {out}")
    out = llm.generate(prompts, max_new_tokens=16, ignore_eos=True)
    say(f"four prompts: {[o[:4] for o in out]}; two-batch forwards {llm.groups[0].call('two_batch_forwards')}")
    llm.shutdown()
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
