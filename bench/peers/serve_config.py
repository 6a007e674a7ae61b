"""`serve run` configs of dsa-pd for a peer-comparison checkpoint on one GPU.

``monolithic``: one decode-role replica that prefills locally (the whole GPU), as vLLM
serves. ``pd``: a prefill and a decode replica sharing the GPU (``num_gpus: 0.5`` each),
KV pushed over NIXL in VRAM. Both: the cuda backend, bf16 activations, fp8 KV caches,
CUDA-graph decode steps up to ``max_batch_size`` requests; page pools sized for
``max_batch_size`` requests of ``max_model_len`` tokens.

    python -m bench.peers.serve_config CKPT --mode pd --out /tmp/dsa_pd.yaml
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from attention.formats import pages_for_tokens


def serve_config(checkpoint: str | Path, mode: str, *, max_model_len: int = 9216, max_batch_size: int = 128,
                 gpu_memory_gib: float = 80.0, chunk_size: int = 8192, port: int = 8000,
                 name: str = "peer-model", prefix_caching: bool = True, engine_process: bool | None = None,
                 gil_switch_interval_ms: float | None = None, ingress_replicas: int | None = None,
                 stream_items_per_s: float | None = None, prefill_graph_max_tokens: int | None = None) -> dict:
    """The `serve run` document (one application) for ``checkpoint`` in ``mode`` ("monolithic" | "pd");
    ``prefix_caching=False``: the prefix cache off (the shared-prefix comparison's baseline);
    ``engine_process`` / ``gil_switch_interval_ms``: those role options on every role (None: the default);
    ``ingress_replicas``: ``ingress.num_replicas`` (None: its default, one per 32 decode streams); ``stream_items_per_s``: the decode role's (None: its default);
    ``prefill_graph_max_tokens``: that role option on every role (None: the default; 0: captured prefills off)."""
    if mode not in ("monolithic", "pd"):
        raise ValueError(f"mode must be 'monolithic' or 'pd', got {mode!r}")
    # Every request of a full batch at its longest, plus one bucket's slack; page ids are shared by all layers.
    num_pages = max_batch_size * pages_for_tokens(max_model_len) + 64
    role = dict(num_replicas=1, num_cpus=2, backend="cuda", device="cuda", dtype="bfloat16", kv_cache_dtype="fp8",
                gpu_memory_gib=gpu_memory_gib, chunk_size=chunk_size, num_pages=num_pages)
    if engine_process is not None:
        role["engine_process"] = engine_process
    if gil_switch_interval_ms is not None:
        role["gil_switch_interval_ms"] = gil_switch_interval_ms
    if prefill_graph_max_tokens is not None:
        role["prefill_graph_max_tokens"] = prefill_graph_max_tokens
    # Graphs sized for the served context, not the model's 160k positions.
    decode = dict(role, num_gpus=1.0 if mode == "monolithic" else 0.5, max_batch_size=max_batch_size,
                  max_ongoing_requests=2 * max_batch_size, cuda_graph_max_context=max_model_len)
    args: dict = {"model": {"path": str(checkpoint), "max_model_len": max_model_len}, "served_model_name": name,
                  "decode": decode}
    if not prefix_caching:
        args["features"] = {"prefix_caching": False}
    if ingress_replicas is not None:
        args["ingress"] = {"num_replicas": ingress_replicas}
    if stream_items_per_s is not None:
        decode["stream_items_per_s"] = stream_items_per_s
    if mode == "monolithic":
        args["mode"] = "monolithic"
    else:
        # Prefill's pool holds what it prefills at once; decode's every running request.
        args["prefill"] = dict(role, num_gpus=0.5, max_batch_size=16,
                               num_pages=16 * pages_for_tokens(max_model_len) + 64)
        args["transfer"] = {"deadline_s": 120, "warmup_at_start": True}
    return {"http_options": {"host": "127.0.0.1", "port": port},
            "applications": [{"name": "dsa-pd", "route_prefix": "/", "import_path": "deployments.app:build_app",
                              "args": args}]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--mode", choices=["monolithic", "pd"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-model-len", type=int, default=9216)
    ap.add_argument("--max-batch-size", type=int, default=128)
    ap.add_argument("--gpu-memory-gib", type=float, default=80.0)
    ap.add_argument("--name", default="peer-model")
    ap.add_argument("--no-prefix-caching", action="store_true", help="the prefix cache off")
    ap.add_argument("--engine-process", choices=["on", "off"], default=None,
                    help="each replica's engine in a process of its own (default: the config's default, on for cuda)")
    ap.add_argument("--gil-switch-interval-ms", type=float, default=None)
    ap.add_argument("--ingress-replicas", type=int, default=None)
    ap.add_argument("--stream-items-per-s", type=float, default=None)
    ap.add_argument("--prefill-graph-max-tokens", type=int, default=None, help="0: captured prefills off")
    args = ap.parse_args(argv)
    doc = serve_config(args.checkpoint, args.mode, max_model_len=args.max_model_len,
                       max_batch_size=args.max_batch_size, gpu_memory_gib=args.gpu_memory_gib, name=args.name,
                       prefix_caching=not args.no_prefix_caching, engine_process=None if args.engine_process is None else args.engine_process == "on",
                       gil_switch_interval_ms=args.gil_switch_interval_ms, ingress_replicas=args.ingress_replicas,
                       stream_items_per_s=args.stream_items_per_s,
                       prefill_graph_max_tokens=args.prefill_graph_max_tokens)
    Path(args.out).write_text(yaml.safe_dump(doc, sort_keys=False))
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
