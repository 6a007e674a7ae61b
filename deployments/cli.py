"""The ``dsa-pd`` command line.

    dsa-pd make-tiny --arch {deepseek_v32,glm_moe_dsa,deepseek_v4} OUT [--seed N] [--fp8] [--tokenizer native]
    dsa-pd generate MODEL_DIR [--prompt TEXT | --token-ids 1,2,3] [--max-new-tokens N] ...
    dsa-pd generate --tiny ARCH ...   (makes the tiny model into a cache dir first)
    dsa-pd check CONFIG.yaml [...] [--gpu-memory-gib G]   (validate serve configs offline)
    dsa-pd serve [--http-frontend haproxy|serve-proxy] CONFIG.yaml [SERVE RUN OPTIONS]   (check, then `serve run`; exit 1 on a violation)
    dsa-pd bench serve [--base-url URL] [--num-prompts N] ...   (load an OpenAI-compatible server; docs/benchmarking.md)
    dsa-pd bench offline --model CKPT [--backend cuda ...]   (the offline engine, per-step timeline)
    dsa-pd bench soak [--base-url URL] [--duration S] ...    (a bounded soak of a running server; docs/reliability.md)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def tiny_model_dir(arch: str, seed: int = 0, fp8: bool = False) -> Path:
    """The tiny model of ``arch`` in the cache directory, made on first use —
    the same directory and atomic making that ``serve run`` configs use."""
    from deployments.app_config import ModelSource

    return ModelSource(tiny={"arch": arch, "seed": seed, "fp8": fp8}).checkpoint_dir(make=True)


def _make_tiny(args) -> int:
    from models.tiny import make_tiny

    path = make_tiny(args.arch, Path(args.out), seed=args.seed, fp8=args.fp8, tokenizer=args.tokenizer)
    print(f"wrote a tiny {args.arch} checkpoint to {path}")
    return 0


def _generate(args) -> int:
    if bool(args.model_dir) == bool(args.tiny):
        print("error: give either MODEL_DIR or --tiny ARCH", file=sys.stderr)
        return 2
    # After the argument check: a usage error answers at once, without loading torch.
    from transformers import AutoTokenizer

    from workers.offline import LLM

    model_dir = Path(args.model_dir) if args.model_dir else tiny_model_dir(args.tiny)
    tokenizer = None
    if args.token_ids:
        ids = [int(t) for t in args.token_ids.split(",")]
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError) as e:
            print(f"error: {model_dir} has no tokenizer ({e}); pass --token-ids", file=sys.stderr)
            return 2
        ids = tokenizer(args.prompt)["input_ids"]
    llm = LLM(model_dir, backend=args.backend, device=args.device, dtype=args.dtype,
              kv_cache_dtype=args.kv_cache_dtype)
    out = llm.generate([ids], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_p=args.top_p, top_k=args.top_k, seed=args.seed)[0]
    print(f"prompt ids:    {ids}")
    print(f"generated ids: {out}")
    if tokenizer is not None:
        print(f"generated text: {tokenizer.decode(out)!r}")
    return 0


def _check(args) -> int:
    """Validate serve config YAMLs: exit 0 when all are valid, 1 on violations, 2 on unreadable files."""
    import yaml

    from deployments.serve_config import check_serve_config, format_report

    gpu_bytes = None if args.gpu_memory_gib is None else int(args.gpu_memory_gib * (1 << 30))
    worst = 0
    for path in args.configs:
        try:
            doc = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            print(f"error: cannot read {path}: {e}", file=sys.stderr)
            worst = 2
            continue
        except yaml.YAMLError as e:
            print(f"error: {path} is not valid YAML: {e}", file=sys.stderr)
            worst = 2
            continue
        report = check_serve_config(doc, gpu_memory_bytes=gpu_bytes)
        print(format_report(path, report, gpu_bytes))
        if not report.ok:
            worst = max(worst, 1)
    return worst


def _serve(args) -> int:
    """`dsa-pd check` the config, then replace this process with `serve run CONFIG ...`.

    Ray's `serve run` keeps running when the application fails to build (the
    build error, with every violation, is in its log and in `serve status`);
    this exits 1 with the report before Ray is started.
    """
    import shutil

    check = argparse.Namespace(configs=[args.config], gpu_memory_gib=args.gpu_memory_gib)
    code = _check(check)
    if code:
        return code
    from deployments import http_frontend

    exe = shutil.which("serve")
    if exe is None:
        print("error: the `serve` command (ray[serve]) is not on PATH", file=sys.stderr)
        return 2
    choice = args.http_frontend or http_frontend.default_choice()
    env = http_frontend.serve_run_env(choice)
    print(http_frontend.describe(choice))
    if choice == "haproxy":
        stopped = http_frontend.stop_stale_haproxies()
        if stopped:
            print(f"stopped {len(stopped)} HAProxy process(es) left by an earlier Ray Serve (pids "
                  f"{', '.join(map(str, stopped))}): they held the HTTP port")
    sys.stdout.flush()
    os.execve(exe, [exe, "run", args.config, *args.serve_args], env)
    return 0  # not reached


def _bench_serve(args) -> int:
    from bench.serve import run

    return run(args)


def _bench_offline(args) -> int:
    from bench.offline import run

    return run(args)


def _bench_soak(args) -> int:
    from bench.soak import run

    return run(args)


def _add_bench(sub) -> None:
    """``dsa-pd bench KIND``: one sub-subcommand per benchmark."""
    from bench.offline import add_arguments as add_offline_arguments
    from bench.serve.cli import add_arguments as add_serve_arguments
    from bench.soak.cli import add_arguments as add_soak_arguments

    p = sub.add_parser("bench", help="benchmarks (`bench serve`: load an OpenAI-compatible server)")
    kinds = p.add_subparsers(dest="bench_command", required=True)
    s = kinds.add_parser("serve", help="async load generator for any OpenAI-compatible server (vllm bench serve's flags)",
                         description="Stream requests to an OpenAI-compatible server at a Poisson rate and report "
                                     "TTFT, TPOT, ITL, E2E latency, throughput and goodput (docs/benchmarking.md).")
    add_serve_arguments(s)
    s.set_defaults(func=_bench_serve)
    o = kinds.add_parser("offline", help="the offline LLM on fixed prefill / decode workloads, a timestamp per step",
                         description="Prefill tokens/s and decode TPOT of the offline engine from a per-step "
                                     "timeline (bench/offline.py).")
    add_offline_arguments(o)
    o.set_defaults(func=_bench_offline)
    k = kinds.add_parser("soak", help="a bounded soak of a running server: streams, cancellations, bad requests",
                         description="Concurrent clients with a mix of lengths, cancellations and bad requests for a "
                                     "fixed time; then no unexpected error, every pool whole and every replica's "
                                     "memory flat (docs/reliability.md).")
    add_soak_arguments(k)
    k.set_defaults(func=_bench_soak)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsa-pd", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny", help="write a deterministic tiny random checkpoint")
    p.add_argument("--arch", required=True, choices=["deepseek_v32", "glm_moe_dsa", "deepseek_v4"])
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp8", action="store_true", help="write weights fp8 block-quantized (128x128)")
    p.add_argument("--tokenizer", default="byte", choices=["byte", "native"],
                   help="'native': the family's real special tokens and chat format (models/tiny_native.py)")
    p.set_defaults(func=_make_tiny)

    p = sub.add_parser("generate", help="generate offline (no server)")
    p.add_argument("model_dir", nargs="?")
    p.add_argument("--tiny", choices=["deepseek_v32", "glm_moe_dsa", "deepseek_v4"],
                   help="use (and make on first use) a tiny model")
    p.add_argument("--prompt", default="Hello, sparse attention!")
    p.add_argument("--token-ids", help="comma-separated prompt token ids (for checkpoints without a tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--backend", default="reference", choices=["reference", "cuda"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.set_defaults(func=_generate)

    p = sub.add_parser("check", help="validate serve config YAMLs (every violation, with its path) without a cluster")
    p.add_argument("configs", nargs="+", metavar="CONFIG.yaml", help="`serve run` config files")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="memory of one GPU for the budget rule (default: each role's gpu_memory_gib)")
    p.set_defaults(func=_check)

    p = sub.add_parser("serve", help="check a serve config, then start it with `serve run` (exit 1 on a violation)")
    p.add_argument("config", metavar="CONFIG.yaml")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="passed on to `serve run`")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="memory of one GPU for the budget rule (default: each role's gpu_memory_gib)")
    p.add_argument("--http-frontend", choices=["haproxy", "serve-proxy"], default=None,
                   help="what answers HTTP in front of the ingress replicas when `serve run` starts its own Ray "
                        "cluster (deployments/http_frontend.py): haproxy (default when its binary is installed, "
                        "unless RAY_SERVE_ENABLE_HA_PROXY says otherwise) or serve-proxy (Ray Serve's Python proxy)")
    p.set_defaults(func=_serve)

    _add_bench(sub)

    args = parser.parse_args(argv)
    from models.config import ConfigError

    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        # A bad checkpoint or argument is the user's to fix: say what, no traceback.
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
