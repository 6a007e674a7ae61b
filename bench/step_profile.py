"""Where a decode step's wall time goes: GPU busy time vs wall, the top kernels, the host's hot functions.

``dsa-pd bench offline ... --profile-steps N`` runs this after the timed cases: for each
decode batch size it starts the batch, runs it into the steady state (every request
decoding, no prefill chunk), then

1. profiles ``N`` `Engine.step` calls under ``torch.profiler`` (CPU + CUDA): wall per
   step (first call's start to last call's end, no sync between calls, as served), GPU
   busy per step (the union of the kernels' and copies' intervals: what a roofline or
   a faster kernel can shrink), the kernel sum, and the top kernels by total time;
2. runs ``N`` more calls under ``cProfile``: the host functions by cumulative time.

``wall / gpu_busy`` is the decode-loop issue's figure: near 1 the GPU is the critical
path; well above, the host (or a sync) is, and the cProfile table says where.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import time

import torch


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
"""This repository's root (the functions and sync points reported are the ones under it)."""


def _busy_union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start_us, end_us)`` intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _gpu_time(prof, top: int) -> tuple[float, float, list[tuple[float, int, str]]]:
    """(GPU busy us: the union of the kernels' and copies' intervals, their sum, the ``top`` names by
    total time as ``(us, calls, name)``) of a finished ``torch.profiler`` run."""
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = _busy_union_us([(e.time_range.start, e.time_range.end) for e in gpu])
    by_name: dict[str, list[float]] = {}
    for e in gpu:
        by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    kernels = sorted(((sum(v), len(v), k) for k, v in by_name.items()), reverse=True)[:top]
    return busy_us, sum(e.time_range.end - e.time_range.start for e in gpu), kernels


def profile_prefill(llm, batch: int, length: int, seed: int = 11, top: int = 20, cached: int = 0) -> dict:
    """One prefill of ``batch`` random prompts of ``length`` tokens (after a cached ``cached``-token prefix,
    `bench.offline.prefill_case`; 1 output token each) under
    ``torch.profiler``: wall, GPU busy, the kernel sum and the ``top`` kernels (ms per prefill), so
    a lease shows where prefill time goes against the peer's in one call."""
    from torch.profiler import ProfilerActivity, profile

    from bench.offline import prefill_case

    cuda = llm.runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cached:
        prefill_case(llm, 1, 1, seed + 3, cached)  # the shared prefix into the cache, outside the profiles
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        case = prefill_case(llm, batch, length, seed, cached, warm=False)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    busy_us, kernel_sum_us, kernels = _gpu_time(prof, top)
    runtime = _runtime_calls(prof)
    idle = _gpu_idle(prof)
    syncs = _sync_points(lambda: prefill_case(llm, batch, length, seed + 2, cached, warm=False)) if cuda else []
    # The same prefill under cProfile: where the host's time goes (a read-back shows as a wait in
    # `synchronize`, `item`, `tolist` or `cpu`, and the device idles after it while the host launches).
    host = cProfile.Profile()
    t0 = time.perf_counter()
    host.enable()
    prefill_case(llm, batch, length, seed + 1, cached, warm=False)  # new prompts: the same ones would hit the prefix cache
    if cuda:
        torch.cuda.synchronize()
    host.disable()
    host_wall = time.perf_counter() - t0
    buf = io.StringIO()
    stats = pstats.Stats(host, stream=buf)
    stats.sort_stats("tottime").print_stats(25)
    return {"case": case["case"], "wall_ms": wall * 1e3, "gpu_busy_ms": busy_us / 1e3,
            "kernel_sum_ms": kernel_sum_us / 1e3, "tokens_per_s_profiled": case["prefill_tokens_per_s"],
            "top_kernels": [{"name": k[:120], "calls": n, "ms": t / 1e3} for t, n, k in kernels],
            "runtime_calls": runtime, "gpu_idle": idle, "sync_points": syncs,
            "repo_cumulative": _repo_rows(stats, 30),
            "cprofile_wall_ms": host_wall * 1e3, "host_cprofile_tottime": buf.getvalue()}


def _runtime_calls(prof) -> list[dict]:
    """The host's CUDA runtime / driver calls under ``prof`` (launches, copies, syncs): name, count,
    total ms. A synchronize or a device-to-host copy here is a stall the GPU idles after."""
    rows: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(("cuda", "cu")):
            rows.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    return [{"name": k, "calls": len(v), "ms": sum(v) / 1e3}
            for k, v in sorted(rows.items(), key=lambda kv: -sum(kv[1]))][:15]


def _gpu_idle(prof, min_gap_us: float = 20.0) -> dict:
    """GPU idle time between the first and the last kernel of ``prof``: gaps longer than ``min_gap_us``
    (host-bound launch stretches and stalls), their count and total, and the kernel count."""
    gpu = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    gaps, end = [], None
    for s, e in gpu:
        if end is not None and s - end > min_gap_us:
            gaps.append(s - end)
        end = e if end is None else max(end, e)
    span = (end - gpu[0][0]) if gpu else 0.0
    return {"kernels": len(gpu), "span_ms": span / 1e3, "gaps": len(gaps), "gap_ms": sum(gaps) / 1e3,
            "largest_gaps_ms": [round(g / 1e3, 3) for g in sorted(gaps, reverse=True)[:8]]}


def _sync_points(run) -> list[dict]:
    """Run ``run()`` under ``torch.cuda.set_sync_debug_mode("warn")``: every synchronizing call, grouped
    by the innermost frame in this repository (file:line), with its count."""
    import traceback
    import warnings

    root = _ROOT
    found: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(root)
                  and not f.filename.endswith("step_profile.py")]
        where = (f"{os.path.relpath(frames[-1].filename, root)}:{frames[-1].lineno} ({frames[-1].name})"
                 if frames else f"{filename}:{lineno}")
        found[where] = found.get(where, 0) + 1

    old = warnings.showwarning
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = old
    return [{"where": k, "count": v} for k, v in sorted(found.items(), key=lambda kv: -kv[1])]


def _repo_rows(stats: pstats.Stats, top: int) -> list[str]:
    """This repository's functions by cumulative time: ``"cum ms  own ms  calls  file:line(function)"``."""
    root = _ROOT
    rows = [(ct, tt, n, f"{os.path.relpath(path, root)}:{line}({fn})")
            for (path, line, fn), (_, n, tt, ct, _) in stats.stats.items() if path.startswith(root)]
    return [f"{ct * 1e3:8.2f} {tt * 1e3:8.2f} {n:6d}  {name}" for ct, tt, n, name in sorted(rows, reverse=True)[:top]]


def print_prefill_profile(p: dict) -> None:
    print(f"profile {p['case']}: wall {p['wall_ms']:.1f} ms, GPU busy {p['gpu_busy_ms']:.1f} ms, kernel sum "
          f"{p['kernel_sum_ms']:.1f} ms ({p['tokens_per_s_profiled']:,.0f} tokens/s under the profiler)", flush=True)
    for k in p["top_kernels"]:
        print(f"  {k['ms']:9.3f} ms  x{k['calls']:5d}  {k['name']}")
    i = p["gpu_idle"]
    print(f"  {i['kernels']} GPU kernels / copies over {i['span_ms']:.1f} ms; GPU idle in {i['gaps']} gaps > 20 us: "
          f"{i['gap_ms']:.1f} ms (largest {i['largest_gaps_ms']})")
    print("  host CUDA runtime calls: " + "; ".join(f"{r['name']} x{r['calls']} {r['ms']:.2f} ms"
                                                   for r in p["runtime_calls"][:8]))
    print("  synchronizing calls (torch sync debug mode): " + ("; ".join(
        f"{r['where']} x{r['count']}" for r in p["sync_points"]) or "none"))
    print("under cProfile, this repository's functions by cumulative time (cum ms, own ms, calls):")
    print("\n".join("  " + r for r in p["repo_cumulative"]))
    print(f"under cProfile: wall {p['cprofile_wall_ms']:.1f} ms; functions by own time:")
    print("\n".join(p["host_cprofile_tottime"].splitlines()[:40]), flush=True)


def _steady(llm, batch: int, input_len: int, output_len: int, seed: int):
    """``batch`` greedy requests of ``input_len`` random tokens, stepped until all decode; returns them."""
    from bench.offline import random_prompts
    from workers.request import Request
    from workers.sample.params import SamplingParams

    eng = llm.engine
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    reqs = [Request(f"profile{batch}-{i}", p, params) for i, p in enumerate(random_prompts(batch, input_len, seed))]
    for r in reqs:
        if eng.add_request(r) is not None:
            raise SystemExit(f"profile batch {batch}: request refused")
    for _ in range(10_000):
        p0 = eng.stats.prefill_tokens
        eng.step()
        if eng.stats.prefill_tokens == p0 and len(eng.scheduler.running) == batch and all(r.output for r in reqs):
            break
    for _ in range(3):  # a few pure decode steps before measuring
        eng.step()
    return reqs


def profile_decode(llm, batch: int, input_len: int, output_len: int, steps: int, seed: int = 7, top: int = 12) -> dict:
    """Profile ``steps`` steady decode steps at ``batch`` (requests of ``output_len`` tokens: fewer
    steps when they would finish first); the requests are aborted afterwards. Returns plain
    numbers and tables (ms per step)."""
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    cuda = llm.runner.device.type == "cuda"
    reqs = _steady(llm, batch, input_len, output_len, seed)
    steps = max(1, min(steps, (output_len - max(len(r.output) for r in reqs)) // 2 - 4))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        wall = time.perf_counter() - t0
        if cuda:
            torch.cuda.synchronize()
    busy_us, kernel_sum_us, kernels = _gpu_time(prof, 10_000)  # every kernel in the JSON, the top printed

    host = cProfile.Profile()
    t1 = time.perf_counter()
    host.enable()
    for _ in range(steps):
        eng.step()
    host.disable()
    host_wall = time.perf_counter() - t1
    text = io.StringIO()
    stats = pstats.Stats(host, stream=text)
    stats.sort_stats("cumulative").print_stats(25)

    for r in reqs:
        eng.abort(r.request_id)
    for _ in range(3):
        eng.step()
    ms = 1e3 / steps
    return {
        "batch": batch, "input_len": input_len, "steps": steps,
        "wall_ms_per_step": wall * ms, "gpu_busy_ms_per_step": busy_us / 1e3 / steps,
        "kernel_sum_ms_per_step": kernel_sum_us / 1e3 / steps,
        "wall_over_gpu_busy": (wall * 1e6) / busy_us if busy_us else None,
        "cprofile_wall_ms_per_step": host_wall * ms,
        "host_python_ms_per_step": sum(r[0] for r in engine_python_rows(stats)) * ms,
        "kernels_per_step": sum(n for _, n, _ in kernels) / steps,
        "top_kernels": [{"name": k[:120], "calls_per_step": n / steps, "ms_per_step": t / 1e3 / steps}
                        for t, n, k in kernels[:top]],
        "all_kernels": [{"name": k[:200], "calls_per_step": n / steps, "ms_per_step": t / 1e3 / steps}
                        for t, n, k in kernels],
        "host_cprofile": text.getvalue(),
    }


def engine_python_rows(stats: pstats.Stats) -> list[tuple[float, float, int, str]]:
    """``(tottime s, cumtime s, calls, "file:line(function)")`` of every function in ``workers/``: the
    engine's own Python (scheduling, inputs, sampling parameters, stop checks and outputs; not the
    model's Python, torch's ops or the kernels they wait for). On any device it is host work that
    overlap scheduling must hide behind the GPU's step, so it can be measured and cut on a CPU too."""
    workers = os.path.join(_ROOT, "workers") + os.sep
    return [(tt, ct, n, f"{os.path.relpath(path, os.path.dirname(workers))}:{line}({fn})")
            for (path, line, fn), (_, n, tt, ct, _) in stats.stats.items() if path.startswith(workers)]


def print_profile(p: dict) -> None:
    busy = p["gpu_busy_ms_per_step"]
    ratio = "-" if p["wall_over_gpu_busy"] is None else f"{p['wall_over_gpu_busy']:.2f}x"
    print(f"profile decode batch {p['batch']}: wall {p['wall_ms_per_step']:.3f} ms/step, GPU busy {busy:.3f} ms/step "
          f"(wall / busy {ratio}), kernel sum {p['kernel_sum_ms_per_step']:.3f} ms/step, "
          f"{p['kernels_per_step']:.0f} kernels/step, under cProfile {p['cprofile_wall_ms_per_step']:.3f} ms/step, of it in the engine's own Python (workers/) "
          f"{p['host_python_ms_per_step']:.3f} ms/step", flush=True)
    for k in p["top_kernels"]:
        print(f"  {k['ms_per_step']:8.4f} ms/step  x{k['calls_per_step']:5.1f}  {k['name']}")
    print("\n".join(p["host_cprofile"].splitlines()[:45]), flush=True)
