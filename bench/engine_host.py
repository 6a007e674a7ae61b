"""The engine's own host work per steady decode step, on any device (CPU included).

Overlap scheduling hides the host's per-step work behind the device's step only while it is shorter;
on the GPU at batch 128 it was as long (docs/perf.md, session 18). This profiles ``--steps`` steady
pure-decode `Engine.step` calls of ``--batch`` greedy requests through the CUDA-graph path's static
buffers (captured on CUDA, eager on CPU) under cProfile, and prints the time spent in ``workers/``'s
own Python lines per step (tottime: scheduling, step inputs, sampling parameters, stop checks,
outputs; not the model or torch) and its top functions. cProfile inflates per-call costs: compare
runs on one machine, not absolute numbers with a GPU host's.

    python -m bench.engine_host --model DIR [--batch 128] [--steps 20] [--device cpu]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats


def main() -> int:
    from bench.step_profile import _steady, engine_python_rows
    from workers.offline import LLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    llm = LLM(args.model, backend="cuda" if cuda else "reference", device=args.device,
              dtype="bfloat16" if cuda else "float32", num_pages=max(64, args.batch * 8),
              max_batch_size=args.batch, chunk_size=4096, cuda_graphs=cuda)
    if not cuda:
        llm.engine.enable_cuda_graphs(512, capture=False)  # the graph path's static buffers, run eagerly
    _steady(llm, args.batch, 16, args.steps * 2 + 40, 7)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        llm.engine.step()
    prof.disable()
    rows = engine_python_rows(pstats.Stats(prof))
    per = 1e3 / args.steps
    print(f"batch {args.batch}: the engine's own Python {sum(r[0] for r in rows) * per:.3f} ms/step "
          f"(workers/, cProfile tottime, {args.steps} steps)")
    for tt, ct, n, name in sorted(rows, reverse=True)[: args.top]:
        print(f"  {tt * per:7.3f} own {ct * per:8.3f} cum ms/step  {n / args.steps:6.1f} calls/step  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
