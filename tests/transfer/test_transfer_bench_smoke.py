"""bench/transfer.py runs end to end on CPU/DRAM with small sizes (numbers are not checked)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.prestart import WorkerRun, temp_dir, worker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


ARGS = {
    "test_bench_transfer_cpu_smoke": (
        "--tokens", "256,1000", "--reps", "1", "--warmup", "--warmup-repeat", "4", "--ucx-sgl", "both", "--paths",
        "auto,prep,flat,init", "--raw-reps", "2"),
    "test_bench_transfer_cpu_cross_layer_and_inflight_stream": (
        "--tokens", "1000", "--reps", "1", "--ucx-sgl", "off", "--layout", "random", "--cache-layout", "cross-layer",
        "--paths", "prep,flat", "--inflight", "2", "--stream", "3", "--stream-reps", "1"),
    "test_bench_transfer_cpu_posting_threads": (
        "--tokens", "1000", "--reps", "2", "--ucx-sgl", "off", "--paths", "prep", "--ucx-threads", "2", "--ucx-param",
        "num_workers=2", "--ucx-param", "split_batch_size=8", "--inflight", "2", "--stream", "4", "--stream-reps", "1",
        "--cache-layout", "layer-major"),
    "test_bench_transfer_cpu_cross_layer_run_pages": (
        "--tokens", "1000", "--reps", "1", "--ucx-sgl", "off", "--layout", "contiguous", "--cache-layout",
        "cross-layer", "--paths", "auto,init", "--run-pages", "5"),
    "test_bench_transfer_cpu_lone_parts_after_device_work": (
        "--tokens", "1000", "--reps", "2", "--ucx-sgl", "off", "--paths", "auto", "--cache-layout", "cross-layer",
        "--forward-ms", "1", "--lone-parts"),
    "test_bench_transfer_cpu_fenced_push_and_copy_alone": (
        "--tokens", "1000", "--reps", "2", "--ucx-sgl", "off", "--paths", "auto", "--cache-layout", "cross-layer",
        "--forward-ms", "1", "--fenced", "--forward-running", "--copy-alone", "--warmup", "--warmup-repeat", "2",
        "--inflight", "2", "--stream", "3", "--stream-reps", "1"),
}
"""Each test's bench arguments (after ``--device cpu --layers 3``)."""


@functools.cache
def bench_run(test: str) -> WorkerRun:
    """``bench/transfer.py --device cpu --layers 3 ARGS --json OUT`` of ``test``, in a directory of its own."""
    work = temp_dir("bench-transfer-")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "transfer.py"), "--device", "cpu", "--layers", "3", *ARGS[test],
           "--json", os.path.join(work, "bench.json")]
    return worker(cmd, lambda: dict(os.environ, UCX_NET_DEVICES="lo"), timeout=120, cwd=work)


PRESTART = {test: functools.partial(bench_run, test) for test in ARGS}
"""The bench runs this module reads, started early (tests/prestart.py): each keeps a core busy for seconds."""


def run_bench(test: str) -> tuple[str, dict]:
    """``test``'s bench run: its stdout and JSON report (it must succeed)."""
    proc = bench_run(test).wait()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout, json.loads(Path(proc.args[-1]).read_text())


def test_bench_transfer_cpu_smoke():
    stdout, report = run_bench("test_bench_transfer_cpu_smoke")
    assert "fraction_of_copy" in stdout and "verified" in stdout
    # Per UCX scatter-gather setting (a fresh pair each): the serving path, prepared merged / unmerged,
    # explicit merged.
    assert [m["ucx_sgl"] for m in report["modes"]] == [False, True]
    assert [(r["ucx_sgl"], r["tokens"], r["path"], r["merge"]) for r in report["rows"]] == [
        (sgl, t, path, merge) for sgl in (False, True) for t in (256, 1000)
        for path, merge in (("auto", True), ("prep", True), ("flat", False), ("init", True))]
    # The re-posted WRITE, per token count and mode: 3 layers (one region each) x the page runs of its pages.
    assert [r["tokens"] for r in report["raw"]] == [256, 1000] * 2
    assert all(r["descriptors"] % 3 == 0 and r["nbytes"] == (4 if r["tokens"] == 256 else 16) * 3 * (41_984 + 8_448)
               and r["fraction_of_copy"] > 0 for r in report["raw"])
    assert all(r["gbps"] > 0 and r["fraction_of_copy"] > 0 for r in report["rows"])
    for mode in report["modes"]:
        assert mode["warmup_seconds"] is not None and mode["first"]["status"] == "done"
    # Unmerged: one descriptor per (region, page); 3 layers (one region each: MLA then indexer bytes per
    # page, as served) x 4 / 16 pages.
    assert [r["descriptors"] for r in report["rows"] if not r["merge"]] == [3 * 4, 3 * 16] * 2
    # The posting time is split into its parts.
    for r in report["rows"]:
        assert r["plan_seconds"] + r["make_seconds"] + r["nixl_post_seconds"] <= r["post_seconds"]


def test_bench_transfer_cpu_cross_layer_and_inflight_stream():
    stdout, report = run_bench("test_bench_transfer_cpu_cross_layer_and_inflight_stream")
    assert "stream: 3 requests back to back, at most 2 outstanding" in stdout and "verified" in stdout
    # cross-layer: one region per side holding every layer's bytes of a page; random page ids.
    assert (report["config"]["cache_layout"], report["config"]["layout"]) == ("cross-layer", "random")
    assert [(r["path"], r["merge"]) for r in report["rows"]] == [("prep", True), ("flat", False)]
    flat = report["rows"][1]
    assert flat["descriptors"] == 16 and flat["nbytes"] == 16 * 3 * (41_984 + 8_448)  # one descriptor per page
    (stream,) = report["streams"]
    assert (stream["tokens"], stream["inflight"], stream["requests"]) == (1000, 2, 3)
    assert stream["nbytes"] == 3 * flat["nbytes"] and stream["descriptors"] <= 3 * 16
    assert stream["gbps"] > 0 and stream["fraction_of_copy"] > 0


def test_bench_transfer_cpu_posting_threads():
    """The GPU push setting's NIXL parameters (posting threads on several UCX
    workers, each WRITE split over them) on real NIXL between two processes:
    every page lands (the bench verifies each region's checksum)."""
    stdout, report = run_bench("test_bench_transfer_cpu_posting_threads")
    assert "verified" in stdout and "UCX backend params {'num_workers': '2', 'split_batch_size': '8'}" in stdout
    # The pool before layer pages: a region per (layer, kind), 3 x 2 of them.
    assert report["config"]["ucx_threads"] == 2 and "cache layer-major (6 region(s), run pages whole runs)" in stdout
    # Enough descriptors for NIXL to split the WRITE (>= split_batch_size).
    assert all(r["descriptors"] >= 8 for r in report["rows"]) and report["streams"][0]["requests"] == 4


def test_bench_transfer_cpu_cross_layer_run_pages():
    """A cross-layer cache with contiguous pages is one descriptor per request; --run-pages cuts it."""
    stdout, report = run_bench("test_bench_transfer_cpu_cross_layer_run_pages")
    assert "verified" in stdout and "(1 region(s), run pages 5)" in stdout
    # 16 pages in one run, cut into 5 + 5 + 5 + 1: four descriptors of whole pages of every layer.
    assert [r["descriptors"] for r in report["rows"]] == [4, 4]
    assert all(r["nbytes"] == 16 * 3 * (41_984 + 8_448) for r in report["rows"])


def test_bench_transfer_cpu_lone_parts_after_device_work():
    stdout, report = run_bench("test_bench_transfer_cpu_lone_parts_after_device_work")
    assert "verified" in stdout and "device busy before a lone push 1.0 ms" in stdout
    assert "parts of 1000 alone (median): push call" in stdout
    (row,) = report["rows"]
    parts = [row["push_call_seconds"], row["copies_seconds"], row["report_seconds"]]
    assert all(p >= 0 for p in parts) and sum(parts) <= row["push_seconds"]


def test_bench_transfer_cpu_fenced_push_and_copy_alone():
    """--fenced pushes through serving's fence path (posted by the poll); --copy-alone times the reference
    copy as a request alone. Both land in the report of every request alone and the first request."""
    stdout, report = run_bench("test_bench_transfer_cpu_fenced_push_and_copy_alone")
    assert "verified" in stdout and "1.0 ms (still running at the push); push fenced (served)" in stdout
    assert "1000 alone (median): from the fence passing" in stdout and "first request: from the fence" in stdout
    (row,) = report["rows"]
    first = report["modes"][0]["first"]
    for r, total in ((row, row["push_seconds"]), (first, first["seconds"])):
        # The fence passes after the push call began, so the time from it is at most the whole push.
        assert 0 < r["from_fence_seconds"] <= total and r["copy_alone_seconds"] > 0
    assert report["streams"][0]["requests"] == 3  # fenced pushes of a stream post and complete too


def test_bench_transfer_refuses_lone_parts_with_fenced_and_an_unfenced_running_forward(tmp_path):
    for args, message in ((["--fenced", "--lone-parts"], "not with --fenced"),
                          (["--forward-ms", "1", "--forward-running"], "--forward-running needs --fenced")):
        cmd = [sys.executable, os.path.join(ROOT, "bench", "transfer.py"), "--device", "cpu", *args]
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
