"""The peer's offline mode: vLLM's ``LLM`` on the workloads of ``dsa-pd bench offline``.

Same prompts (``bench.offline.random_prompts``, same seed), greedy, ignore EOS. vLLM's
offline API gives no per-step times, so its TPOT is the difference of two runs over the
same prompts (``--output-len`` and half of it) divided by the tokens between them; its
prefill tokens/s is B*L over a run of one new token. The decode cases' token ids go to
``--json`` in the shape ``bench/peers/agreement.py`` reads.

    PYTHONPATH=/tmp/vsite:$PWD python3 -m bench.peers.vllm_offline --model CKPT --json vllm.json
"""

from __future__ import annotations

import argparse
import json
import time

from bench.offline import random_prompts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prefill", nargs="*", default=["8x4096", "1x16000"])
    ap.add_argument("--batch-sizes", nargs="*", type=int, default=[1, 32, 128])
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--kv-cache-dtype", default="fp8")
    ap.add_argument("--max-model-len", type=int, default=17408)
    ap.add_argument("--enforce-eager", action="store_true", help="no compile / CUDA graphs (agreement-only runs)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from vllm import LLM, SamplingParams

    cases = [tuple(int(x) for x in c.lower().split("x")) for c in args.prefill]
    t0 = time.perf_counter()
    llm = LLM(model=args.model, kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
              max_num_seqs=max([b for b, _ in cases] + args.batch_sizes), gpu_memory_utilization=0.85,
              enforce_eager=args.enforce_eager, seed=0,
              # The TPOT difference re-runs the same prompts: a prefix cache would skip their prefill.
              enable_prefix_caching=False)
    startup = time.perf_counter() - t0

    def gen(prompts, n):
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        s = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return time.perf_counter() - s, [list(o.outputs[0].token_ids) for o in outs]

    gen(random_prompts(2, 512, args.seed + 99), 4)  # warm-up
    out = {"engine": "vllm", "model": args.model, "startup_s": startup, "cases": []}
    for b, n in cases:
        dt, _ = gen(random_prompts(b, n, args.seed), 1)
        out["cases"].append({"case": f"prefill {b}x{n}", "batch": b, "input_len": n, "prefill_tokens_per_s": b * n / dt,
                             "prefill_s": dt})
        print(f"prefill {b}x{n}: {b * n / dt:,.0f} tokens/s ({dt:.3f} s)", flush=True)
    half = args.output_len // 2
    for b in args.batch_sizes:
        prompts = random_prompts(b, args.input_len, args.seed)
        t_half, _ = gen(prompts, half)
        t_full, ids = gen(prompts, args.output_len)
        tpot = 1e3 * (t_full - t_half) / (args.output_len - half)
        out["cases"].append({"case": f"decode batch {b}", "batch": b, "input_len": args.input_len,
                             "output_len": args.output_len, "tpot_ms_difference": tpot, "token_ids": ids})
        print(f"decode batch {b}: TPOT {tpot:.2f} ms ({half} vs {args.output_len} tokens)", flush=True)
    print(f"start-up {startup:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
