"""``dsa-pd bench offline``: the offline engine (`workers.offline.LLM`) on fixed workloads,
with a timestamp per engine step.

Workloads (the peer's offline mode runs the same ones: ``bench/peers/vllm_offline.py``):

* prefill ``BxL``: B prompts of L random tokens, one new token each; tokens/s = B*L over
  the time from the first step to the last prefill step. ``BxL+C``: each prompt is one shared
  C-token prefix, cached beforehand (an untimed request), then L new tokens (the first the same in
  every prompt, the rest random): the prefill of a prefix-cache hit (only the L new tokens count; C a
  multiple of the page size is cached whole).
* decode at batch B: B prompts of ``--input-len`` tokens generating ``--output-len`` tokens
  each (ignore EOS, greedy). TPOT is read from the step timeline, not from totals: the
  median (and mean) duration of the steps that ran no prefill chunk while all B requests
  were running (each `Engine.step` call, without a device sync between calls: under
  overlap scheduling a call returns the previous step's tokens).

Every step's ``(start_s, end_s, prefill_tokens, decode_tokens)`` and every request's greedy
token ids go to ``--json`` (the ids let ``bench/peers/agreement.py`` compare engines).

``--grammar-regex R`` constrains every decode request's output to the regular expression ``R``
(structured outputs: a token mask per row and step). What a constrained batch costs is its
TPOT against the same run without it (and ``--no-overlap`` shows what overlap scheduling saves
with constrained rows); pick an ``R`` that does not end within ``--output-len`` tokens, e.g.
``"[a-z ,.]+"`` (a row whose grammar completes stops early and leaves the steady state).

    dsa-pd bench offline --model CKPT --backend cuda --device cuda --dtype bfloat16 \\
        --kv-cache-dtype fp8 --prefill 8x4096 1x16000 --batch-sizes 1 32 128 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

# torch is imported where it is used: `dsa-pd` builds every subcommand's parser from
# `add_arguments`, and a module-level import cost each command (`check`, `serve`, a usage
# error) ~2 s of loading torch.


def random_prompts(n: int, length: int, seed: int, vocab: int = 256) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids in ``[0, vocab)``, from ``seed`` (the bench serve default range).

    The generator's seed mixes in ``n`` and ``length``: drawn from ``seed`` alone, the cases of one run
    (1 x 1024, then 1 x 512 with the same seed) shared their leading tokens, and every case after the
    first was a prefix-cache hit, not the prefill it is named after."""
    import torch

    g = torch.Generator().manual_seed((seed * 1_000_003 + n * 10_007 + length) % (1 << 63))
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def timed_run(llm, prompts: list[list[int]], max_new_tokens: int, tag: str, grammar=None) -> dict:
    """Run ``prompts`` greedily to ``max_new_tokens`` each through ``llm.engine``, one timestamp per step.
    grammar: a `workers.structured.GrammarSpec` every request's output must match (None: free)."""
    import torch

    from workers.request import Request
    from workers.sample.params import SamplingParams

    eng = llm.engine
    sync = torch.cuda.synchronize if llm.runner.device.type == "cuda" else (lambda: None)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, grammar=grammar)
    reqs = [Request(f"{tag}-{i}", list(p), params) for i, p in enumerate(prompts)]
    for r in reqs:
        rejected = eng.add_request(r)
        if rejected is not None:
            raise SystemExit(f"{tag}: request refused: {rejected.error}")
    steps = []
    sync()
    t0 = time.perf_counter()
    while any(not r.finished for r in reqs):
        p0, d0 = eng.stats.prefill_tokens, eng.stats.decode_tokens
        running = len(eng.scheduler.running)
        start = time.perf_counter()
        # No sync per step: with overlap scheduling a call launches one step and reads the
        # previous one back, so in the steady state a call lasts one device step (or the
        # host's work, when that is longer), which is the pace tokens come out at.
        eng.step()
        end = time.perf_counter()
        steps.append({"start_s": start - t0, "end_s": end - t0, "prefill_tokens": eng.stats.prefill_tokens - p0,
                      "decode_tokens": eng.stats.decode_tokens - d0, "running_before": running})
    eng.flush()  # a step launched after the last tokens: not part of the timeline
    sync()
    return {"steps": steps, "token_ids": [list(r.output) for r in reqs], "prompts": len(prompts),
            "total_s": steps[-1]["end_s"] if steps else 0.0}


def parse_prefill_case(text: str) -> tuple[int, int, int]:
    """``"BxL"`` or ``"BxL+C"`` -> (batch, new tokens per prompt, cached prefix tokens)."""
    head, _, cached = text.lower().partition("+")
    try:
        batch, length = (int(x) for x in head.split("x"))
        prefix = int(cached) if cached else 0
    except ValueError:
        raise SystemExit(f"--prefill {text!r}: expected BxL or BxL+C (e.g. 8x4096, 1x256+8192)") from None
    if batch < 1 or length < 1 or prefix < 0:
        raise SystemExit(f"--prefill {text!r}: B and L must be positive, C not negative")
    return batch, length, prefix


def prefill_case(llm, batch: int, length: int, seed: int, cached: int = 0, warm: bool = True) -> dict:
    """B prompts of ``length`` new tokens; with ``cached`` > 0, after one shared prefix of that many tokens
    (the same for every seed) which an untimed request puts in the prefix cache first (``warm``; a caller
    that warmed it already, as a profile does outside its window, passes False)."""
    # Every prompt continues the prefix with the same token (a chat template's next marker does the
    # same): with MTP on a cached page's key covers the token after it (`workers.prefix_cache.key_lookahead`),
    # so the prefix's last page is a hit only for prompts that agree on that token.
    prefix = random_prompts(1, cached + 1, 7919)[0] if cached else []
    if cached and warm:
        timed_run(llm, [prefix], 1, f"prefix{cached}-{seed}")  # its full pages stay cached
    tag = f"prefill{batch}x{length}" + (f"+{cached}" if cached else "")
    suffixes = random_prompts(batch, length - 1 if cached else length, seed)
    run = timed_run(llm, [prefix + p for p in suffixes], 1, tag)
    last_prefill = max(s["end_s"] for s in run["steps"] if s["prefill_tokens"])
    return {"case": f"prefill {batch}x{length}" + (f" over {cached} cached" if cached else ""), "batch": batch,
            "input_len": length, "cached_prefix": cached, "prefill_tokens_per_s": batch * length / last_prefill,
            "prefill_s": last_prefill, **run}


def decode_case(llm, batch: int, input_len: int, output_len: int, seed: int, grammar=None) -> dict:
    run = timed_run(llm, random_prompts(batch, input_len, seed), output_len, f"decode{batch}", grammar)
    # Steady state: no prefill chunk in the step and the whole batch running.
    pure = [s["end_s"] - s["start_s"] for s in run["steps"]
            if not s["prefill_tokens"] and s["running_before"] == batch and s["decode_tokens"]]
    per_tok = [(s["end_s"] - s["start_s"]) / (s["decode_tokens"] / batch) for s in run["steps"]
               if not s["prefill_tokens"] and s["running_before"] == batch and s["decode_tokens"]]
    return {"case": f"decode batch {batch}", "batch": batch, "input_len": input_len, "output_len": output_len,
            "grammar": None if grammar is None else f"{grammar.kind}:{grammar.value}", "steady_steps": len(pure),
            "tpot_ms_median": 1e3 * statistics.median(per_tok) if per_tok else None,
            "tpot_ms_mean": 1e3 * statistics.fmean(per_tok) if per_tok else None,
            "step_ms_median": 1e3 * statistics.median(pure) if pure else None, **run}


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--backend", default="reference", choices=["reference", "cuda"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-cache-dtype", default="fp8", choices=["auto", "fp8"])
    p.add_argument("--prefill", nargs="*", default=["8x4096", "1x16000"], help="prefill cases BxL, or BxL+C: L new tokens after a cached C-token prefix")
    p.add_argument("--batch-sizes", nargs="*", type=int, default=[1, 32, 128], help="decode batch sizes")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens of the decode cases")
    p.add_argument("--output-len", type=int, default=256, help="tokens generated per decode request")
    p.add_argument("--chunk-size", type=int, default=8192)
    p.add_argument("--num-pages", type=int, default=None, help="default: what the largest case needs")
    p.add_argument("--mtp-draft-tokens", type=int, default=0)
    p.add_argument("--cuda-graph-max-context", type=int, default=0,
                   help="the longest context the decode and prefill-rows graphs serve (default: the longest "
                        "case's prompt + output, in whole pages)")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--prefill-graph-max-tokens", type=int, default=None,
                   help="prefills of one new prompt up to this many tokens replay a CUDA graph "
                        "(workers/prefill_graphs.py; default 1024 capped by index_topk and --chunk-size; 0: off)")
    p.add_argument("--no-overlap", action="store_true", help="read every step back before the next (no overlap scheduling)")
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel ranks (one Ray actor per GPU; the routed experts are split across them too)")
    p.add_argument("--two-batch-overlap", action="store_true",
                   help="with --tp-size > 1, reference backend: each eager forward as two micro-batches whose "
                        "all-reduces overlap the other's compute (models/two_batch.py)")
    p.add_argument("--grammar-regex", default=None,
                   help="constrain every decode request's output to this regex (structured outputs; the "
                        "checkpoint needs a tokenizer)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default=None, help="write every case, with its step timeline and token ids")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after the timed cases, profile this many steady decode steps per batch size "
                        "(GPU busy vs wall, top kernels, host cProfile: bench/step_profile.py)")
    p.add_argument("--profile-prefill", action="store_true",
                   help="after the timed cases, profile one pass of each --prefill case (GPU busy vs wall, "
                        "top kernels: bench/step_profile.py)")
    return p


def run(args) -> int:
    import torch

    from attention.formats import PAGE_SIZE, pages_for_tokens
    from workers.offline import LLM
    from workers.structured import GrammarSpec

    grammar = None if args.grammar_regex is None else GrammarSpec("regex", args.grammar_regex)
    cases = [parse_prefill_case(c) for c in args.prefill]
    need = max([pages_for_tokens(c) + b * pages_for_tokens(n + 1) for b, n, c in cases]
               + [b * pages_for_tokens(args.input_len + args.output_len) for b in args.batch_sizes] + [1])
    num_pages = args.num_pages or need + 16
    # The graphs serve the longest case, not the whole pool: a pool-wide context would size the rows
    # graphs' indexer logits for ~150k tokens and cap their rows (`row_cap`) below a 256-token suffix.
    longest = max([c + n + 1 for _, n, c in cases] + [args.input_len + args.output_len + 1])
    max_context = args.cuda_graph_max_context or pages_for_tokens(longest) * PAGE_SIZE
    max_batch = max([b for b, _, _ in cases] + args.batch_sizes + [1])
    t0 = time.perf_counter()
    llm = LLM(args.model, backend=args.backend, device=args.device, dtype=args.dtype,
              kv_cache_dtype=args.kv_cache_dtype, num_pages=num_pages, chunk_size=args.chunk_size,
              max_batch_size=max_batch, mtp_draft_tokens=args.mtp_draft_tokens,
              cuda_graphs=False if args.no_cuda_graphs else None, cuda_graph_max_context=max_context,
              overlap_scheduling=not args.no_overlap,
              prefill_graph_max_tokens=args.prefill_graph_max_tokens, tp_size=args.tp_size, two_batch_overlap=args.two_batch_overlap)
    try:
        return _run_cases(args, llm, cases, grammar, time.perf_counter() - t0, num_pages)
    finally:
        llm.shutdown()


def _run_cases(args, llm, cases, grammar, startup: float, num_pages: int) -> int:
    import torch

    out = {"model": args.model, "backend": args.backend, "device": args.device, "dtype": args.dtype,
           "overlap_scheduling": not args.no_overlap, "grammar_regex": args.grammar_regex,
           "tp_size": args.tp_size, "two_batch_overlap": args.two_batch_overlap,
           "prefill_graph_buckets": list(llm.runner.prefill_graphs.plan.buckets)
           if getattr(llm.runner, "prefill_graphs", None) is not None else [],
           "kv_cache_dtype": args.kv_cache_dtype, "startup_s": startup, "num_pages": num_pages, "cases": []}
    if torch.cuda.is_available() and args.device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name()
    # One untimed pass of every case first: kernels compile (Triton JIT) on a shape's first use. Its
    # speed is printed as the first prompts after start-up see it (start-up warms the prefill kernels
    # on the cuda backend: workers/kernel_warmup.py).
    for b, n, c in cases:
        cold = prefill_case(llm, b, n, args.seed + 99, c)
        out.setdefault("first_pass", []).append({k: cold[k] for k in ("case", "prefill_tokens_per_s", "prefill_s")})
        print(f"{cold['case']} (first pass after start-up): {cold['prefill_tokens_per_s']:,.0f} tokens/s", flush=True)
    for b in args.batch_sizes:
        decode_case(llm, b, args.input_len, 4, args.seed + 98, grammar)
    for b, n, cached in cases:
        c = prefill_case(llm, b, n, args.seed, cached)
        out["cases"].append(c)
        print(f"{c['case']}: {c['prefill_tokens_per_s']:,.0f} tokens/s ({c['prefill_s']:.3f} s)", flush=True)
    for b in args.batch_sizes:
        c = decode_case(llm, b, args.input_len, args.output_len, args.seed, grammar)
        out["cases"].append(c)
        tpot = "-" if c["tpot_ms_median"] is None else f"{c['tpot_ms_median']:.2f}"
        print(f"{c['case']}: TPOT median {tpot} ms over {c['steady_steps']} steady steps", flush=True)
    if args.profile_steps:
        from bench.step_profile import print_profile, profile_decode

        out["profiles"] = []
        for b in args.batch_sizes:
            prof = profile_decode(llm, b, args.input_len, args.output_len, args.profile_steps)
            print_profile(prof)
            out["profiles"].append(prof)
    if args.profile_prefill:
        from bench.step_profile import print_prefill_profile, profile_prefill

        out["prefill_profiles"] = []
        for b, n, cached in cases:
            prof = profile_prefill(llm, b, n, cached=cached)
            print_prefill_profile(prof)
            out["prefill_profiles"].append(prof)
    out["two_batch_forwards"] = llm.stats()["two_batch_forwards"]
    print(f"start-up {startup:.1f} s; pool free {llm.pool.free_count}/{llm.pool.num_pages}; forwards as two "
          f"micro-batches: {out['two_batch_forwards']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = add_arguments(argparse.ArgumentParser(prog="dsa-pd bench offline", description=__doc__.split("\n\n")[0]))
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
