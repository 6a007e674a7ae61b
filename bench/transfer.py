#!/usr/bin/env python
"""NIXL push bench: one DeepSeek-V3.2 request's pages, prefill process -> decode process.

Geometry (defaults): 61 layers x (41,984 B MLA + 8,448 B indexer) per 64-token
page = 3.08 MB per page; requests of 8k and 32k prompt tokens (394 MB and
1.58 GB). The prefill process pushes (NIXL WRITE) every page of every layer
into the pages the decode process reserved, through `transfer.Pusher` /
`transfer.Receiver` exactly as serving does.

Reported, all from one run:
- the reference: a torch copy of the same number of bytes, prefill device ->
  decode device, in the prefill process (the device-to-device roofline);
- per UCX scatter-gather setting (``--ucx-sgl``: off, on or both, each with
  a fresh pair of processes): the first (cold) request after the pair
  starts, and with ``--warmup`` the warm-up cost paid at start instead;
- warm requests (median of ``--reps``) per path (``--paths``): ``auto`` (the
  serving default: explicit descriptors, one per region and page run, while
  a chunk needs few, else prepared lists), ``prep`` / ``flat`` (indices into
  descriptor lists prepared at start / handshake, ``make_prepped_xfer``,
  with / without merging), ``init`` (explicit descriptors through
  ``initialize_xfer``);
- each as GB/s and as a fraction of the reference copy, with the posting
  time split: ``plan_ms`` (indices / descriptors in Python), ``make_ms``
  (NIXL request creation), ``nixl_post_ms`` (inside NIXL ``transfer``: the
  backend issuing every descriptor); ``post_ms`` is all of begin + push.
  ``push_ms`` runs from ``Pusher.begin`` to completion; ``from_push_ms``
  from the ``push`` call (serving calls ``begin`` when decode has reserved
  the pages, before prefill computes, so this is the part on the critical
  path once the prompt's cache is final), waiting as a prefill round does
  (`Pusher.poll` spinning on the WRITE's state); ``to_decode_ms`` from the
  push call until the decode process saw the request complete (both
  processes' ``perf_counter``, one system-wide monotonic clock on Linux);
- with ``--fenced``: every push fenced as served (a CUDA event; the WRITE is
  posted by the poll that sees it pass); with ``--forward-running`` too, the push is called while the
  ``--forward-ms`` device work still runs (serving pushes after the MTP
  layer's forward is enqueued). A request alone is also timed from the fence
  passing (``from_fence``: the part on the critical path once the pages are
  written);
- with ``--copy-alone``: before each request alone, a torch copy of its
  bytes timed the same way (the prefill process comes out of a pipe read,
  copies, waits): what the device gives a lone copy, next to the copy timed
  back to back that every fraction above is of;
- with ``--raw-reps N``: one request's WRITE posted again N times (no plan,
  no request creation, no notification): the transport's own time;
- with ``--inflight N``: a stream of ``--stream`` requests (default 4N) pushed
  back to back on the serving path, at most N outstanding, as aggregate GB/s
  (all bytes / first begin to last completion) and as a fraction of the copy.
  A single request's time includes fixed costs (posting, completion polling,
  notification) that a stream overlaps with other requests' copies; this is
  the throughput a prefill replica can sustain.

Cache layouts (``--cache-layout``), as `attention.cache.PagedKVCache`
lays its pages out (``CacheSpec.page_layout``): ``per-layer`` (one region per
layer whose page holds the layer's MLA then indexer bytes, so a run of pages
is one descriptor per layer), ``cross-layer`` (one region whose page holds
every layer's MLA and indexer bytes back to back: a run of pages is one
descriptor; ``--run-pages N`` cuts it into pieces of at most N pages), and
``layer-major`` (the pool before session 4: one region per (layer, kind),
two descriptors per layer and run). Page-id layouts (``--layout``):
``contiguous``, ``runs`` (1-16), ``random`` (no two adjacent).

GPU (the default): ``python bench/transfer.py [--devices 0,1] [--warmup]``;
``bench/gpu_transfer.sh`` runs the cases that decide the next step.
CPU smoke run: ``python bench/transfer.py --device cpu --layers 4 --tokens 512,2048``.
"""

from __future__ import annotations

import os
import sys

_BENCH = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_BENCH)
# Run as a script, sys.path[0] is bench/ and `import transfer` would find this
# file; the repository root must come first.
sys.path[:] = [_ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != _BENCH]

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from typing import Any, Optional  # noqa: E402

from attention.formats import PAGE_SIZE, pages_for_tokens  # noqa: E402

DSV32_LAYERS = 61
DSV32_MLA_BYTES = 64 * 656  # 41,984: fp8 latent + scales + bf16 rope, per 64-token page
DSV32_INDEX_BYTES = 64 * 132  # 8,448: fp8 keys + f32 scales


@dataclass(frozen=True)
class BenchConfig:
    device: str  # "cuda" or "cpu"
    prefill_device: int
    decode_device: int
    layers: int
    mla_bytes: int
    index_bytes: int
    pool_pages: int
    layout: str  # page ids: "contiguous" | "runs" | "random"
    deadline_s: float
    progress_thread: bool
    ucx_sgl: bool = False
    ucx_threads: int = 0
    cache_layout: str = "per-layer"  # or "cross-layer" (one region), "layer-major" (a region per layer and kind)
    backend_params: tuple = ()  # (key, value) pairs: NIXL UCX backend init parameters
    receiver_defaults: bool = False  # the decode agent keeps NIXL's defaults (no threads, params, SGL)
    run_pages: Optional[int] = None  # `Pusher(run_pages=...)`: the most pages per descriptor
    prefill_progress_thread: bool = True  # False: only the decode agent runs NIXL's progress thread
    forward_ms: float = 0.0  # device work run just before each request alone, as the forward that wrote its pages
    lone_parts: bool = False  # a request alone is also timed in parts (push call, copies, reporting poll)
    fenced: bool = False  # pushes are fenced as served (`workers.kv_link.cuda_event_fence`)
    forward_running: bool = False  # the device work of forward_ms is still running at the (fenced) push
    fence_kind: str = "served"  # or "event" (always one), "query" (none if the stream is idle), "sync" (wait)
    copy_alone: bool = False  # each request alone is preceded by a torch copy of its bytes, timed alone the same way

    @property
    def bytes_per_page(self) -> int:
        return self.layers * (self.mla_bytes + self.index_bytes)


def page_ids(layout: str, n: int, pool_pages: int, rng: random.Random) -> list[int]:
    """``n`` page ids of a ``pool_pages`` pool as a page pool would hand them out.

    contiguous: a fresh pool (ascending ids). runs: a fragmented pool, random
    runs of 1-16 consecutive pages in random order. random: no two adjacent.
    """
    if layout == "contiguous":
        return list(range(n))
    if layout == "random":
        return rng.sample(range(pool_pages), n)
    runs, p = [], 0
    while p < pool_pages:
        k = rng.randint(1, 16)
        runs.append(list(range(p, min(p + k, pool_pages))))
        p += k
    rng.shuffle(runs)
    return [q for run in runs for q in run][:n]


# -- the two sides (each in its own process) -----------------------------------------


class Side:
    def __init__(self, role: str, cfg: BenchConfig):
        import torch

        from attention.cache import ALL_LAYERS
        from transfer import CacheRegion, CompatInfo, PeerBook, Pusher, Receiver, TransferAgent

        self.cfg, self.role = cfg, role
        if cfg.device == "cuda":
            dev_id = cfg.prefill_device if role == "prefill" else cfg.decode_device
            torch.cuda.set_device(dev_id)
            self.dev = torch.device("cuda", dev_id)
        else:
            # One copy thread, like UCX's own memcpy: an OpenMP team on a busy
            # CPU stalls on its slowest thread and distorts the reference.
            torch.set_num_threads(1)
            self.dev = torch.device("cpu")
        gen = torch.Generator(device=self.dev).manual_seed(1 if role == "prefill" else 2)

        def buf(bpp: int):
            # Distinct random bytes per side so a missed page shows in the checksum.
            return torch.randint(0, 256, (cfg.pool_pages, bpp), dtype=torch.uint8, device=self.dev, generator=gen)

        if cfg.cache_layout == "cross-layer":
            # One uint8 [pool_pages, layers * (mla + index)] region: page p of
            # every layer and kind is one contiguous block, one descriptor.
            self.regions = [CacheRegion.of(ALL_LAYERS, "kv", buf(cfg.bytes_per_page))]
        elif cfg.cache_layout == "per-layer":
            # The serving layout: per layer, uint8 [pool_pages, mla_bytes + index_bytes].
            self.regions = [CacheRegion.of(layer, "kv", buf(cfg.mla_bytes + cfg.index_bytes))
                            for layer in range(cfg.layers)]
        else:
            # The pool before: per layer, uint8 [pool_pages, mla_bytes] and [pool_pages, index_bytes].
            self.regions = [
                CacheRegion.of(layer, kind, buf(bpp))
                for layer in range(cfg.layers)
                for kind, bpp in (("mla", cfg.mla_bytes), ("index", cfg.index_bytes))
            ]
        self._forward_bufs, self._forward_copies = None, 0
        if cfg.forward_ms > 0 and role == "prefill":
            self._calibrate_forward(cfg.forward_ms)
        if cfg.device == "cuda":
            torch.cuda.synchronize()
        compat = CompatInfo("bench/dsv32-shaped", cfg.layers, PAGE_SIZE, "fp8_656", "fp8_132", False)
        if role == "decode" and cfg.receiver_defaults:
            tuning = {}  # the receiver never posts: NIXL's defaults
        else:
            params = dict(cfg.backend_params)
            if cfg.ucx_threads:
                params.setdefault("num_threads", str(cfg.ucx_threads))
            tuning = dict(ucx_sgl=cfg.ucx_sgl, backend_params=params)
        self.agent = TransferAgent(f"bench-{role}", self.regions, compat, progress_thread=cfg.progress_thread and (role == "decode" or cfg.prefill_progress_thread),
                                   **tuning)
        self.book = PeerBook(self.agent)
        self._fence_passed_at: Optional[float] = None
        fence = self._timed_fence() if cfg.fenced and role == "prefill" else None
        self.pushers = {row: Pusher(self.agent, self.book, merge=row[1], path=row[0], run_pages=cfg.run_pages,
                                    fence=fence)
                        for row in ROWS.values()}
        self._copy_bufs: dict[int, tuple[Any, Any]] = {}
        # The bench picks page ids itself (no pool): nothing to give back.
        self.receiver = Receiver(self.agent, self.book, release_pages=lambda pages: None)

    def _calibrate_forward(self, ms: float) -> None:
        """Size `_forward`: copies of a 64 MB scratch buffer that take ``ms`` on this device."""
        import torch

        a = torch.ones(64 << 20, dtype=torch.uint8, device=self.dev)
        self._forward_bufs = (a, torch.empty_like(a))
        self._forward_copies = 1
        self._forward()  # first touch
        t0 = time.perf_counter()
        self._forward_copies = 10
        self._forward()
        per_copy = (time.perf_counter() - t0) / 10
        self._forward_copies = max(1, round(ms * 1e-3 / per_copy))

    def _forward(self, wait: bool = True) -> None:
        """Keep the device busy, as the prefill forward that wrote a request's pages does right before
        its push (a GPU left idle between requests clocks down: the copies after it are slower).
        ``wait``: return once the device work ran (as a forward that samples the first token does);
        else right after enqueueing it (as serving's push after the MTP layer's forward)."""
        import torch

        src, dst = self._forward_bufs
        for _ in range(self._forward_copies):
            dst.copy_(src)
        if wait and self.cfg.device == "cuda":
            torch.cuda.synchronize()

    def _timed_fence(self):
        """The push's fence per ``--fence-kind`` (``served``: `workers.kv_link.cuda_event_fence`; on CPU
        the pages are written when the forward returns), noting when its query first says the
        pages are written: the moment a fenced push can be posted."""
        import torch

        def written_now() -> bool:
            return True

        if self.cfg.device != "cuda":
            fence = lambda: written_now  # noqa: E731 - pages are written when the forward returns
        else:
            from workers.kv_link import cuda_event_fence

            served = cuda_event_fence(self.dev)

            def event_fence():
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.dev))
                return event.query

            def fence():
                if self.cfg.fence_kind == "event":
                    return event_fence()
                if self.cfg.fence_kind == "sync":
                    torch.cuda.current_stream(self.dev).synchronize()  # the caller waits for the pages
                    return written_now
                return served()  # "served", and "query" (what is served since session 8)

        def timed():
            query = fence()

            def written() -> bool:
                if not query():
                    return False
                if self._fence_passed_at is None:
                    self._fence_passed_at = time.perf_counter()
                return True

            return written

        return timed

    def name(self) -> str:
        return self.agent.name

    def offer(self) -> bytes:
        return self.book.offer().to_bytes()

    def respond(self, offer: bytes) -> bytes:
        return self.book.respond(offer)

    def accept(self, offer: bytes) -> str:
        return self.book.accept(offer).agent_name

    def info(self) -> dict[str, Any]:
        import importlib.metadata as md

        import torch

        out = {"torch": torch.__version__, "nixl": md.version("nixl"), "device": str(self.dev),
               "host_cpus": len(os.sched_getaffinity(0))}
        if self.cfg.device == "cuda":
            out["gpu"] = torch.cuda.get_device_name(self.dev)
            out["cuda"] = torch.version.cuda
            out["gpu_count"] = torch.cuda.device_count()
        else:
            import platform

            out["cpu"] = platform.processor() or platform.machine()
            out["threads"] = torch.get_num_threads()
        return out

    def checksum(self, pages: list[int]) -> list[int]:
        """Per region: sum_i (i+1) * sum(bytes of page pages[i]) (order-sensitive), int64."""
        import torch

        idx = torch.tensor(pages, dtype=torch.long, device=self.dev)
        w = torch.arange(1, len(pages) + 1, dtype=torch.int64, device=self.dev)
        return [int((r.tensor[idx].to(torch.int64).sum(dim=1) * w).sum()) for r in self.regions]

    # decode side
    def reserve(self, rid: str, peer: str, tokens: int, pages: list[int]) -> None:
        self.receiver.expect(rid, peer, tokens, pages, self.cfg.deadline_s)

    def wait(self) -> dict[str, Any]:
        """Poll until a request ends; ``at``: when this side saw it (perf_counter, CLOCK_MONOTONIC on
        Linux: comparable with the prefill process's)."""
        while True:
            for r in self.receiver.poll():
                return {"status": r.status.value, "seconds": r.seconds, "reason": r.reason,
                        "at": time.perf_counter()}
            time.sleep(0)  # yield: on a small CPU the pusher needs the core

    def spin(self, seconds: float) -> int:
        """Poll the receiver for ``seconds`` as a serving decode worker does (busy); returns messages seen."""
        end, n = time.perf_counter() + seconds, 0
        while time.perf_counter() < end:
            n += len(self.receiver.poll())
            time.sleep(0)
        return n

    def reserve_many(self, reqs: list[tuple[str, str, int, list[int]]]) -> None:
        """`reserve` for every ``(request id, prefill agent, tokens, decode pages)`` of a stream."""
        for rid, peer, tokens, pages in reqs:
            self.receiver.expect(rid, peer, tokens, pages, self.cfg.deadline_s)

    def wait_many(self, count: int) -> dict[str, int]:
        """Poll until ``count`` requests ended; returns how many ended with each status."""
        statuses: dict[str, int] = {}
        while sum(statuses.values()) < count:
            for r in self.receiver.poll():
                statuses[r.status.value] = statuses.get(r.status.value, 0) + 1
            time.sleep(0)
        return statuses

    # prefill side
    def copy_reference(self, nbytes: int, reps: int) -> float:
        """Median seconds of a torch copy of ``nbytes``, prefill device -> decode device."""
        src, dst = self._copy_buffers(nbytes)
        times = [self._timed_copy(src, dst) for _ in range(reps)]
        del src, dst
        return statistics.median(times)

    def copy_alone(self, nbytes: int) -> float:
        """Seconds of one torch copy of ``nbytes`` (prefill device -> decode device) from the call until
        it ended: the reference copy timed as a request alone is (the process comes out of a pipe read)."""
        if nbytes not in self._copy_bufs:
            self._copy_bufs[nbytes] = self._copy_buffers(nbytes)
        return self._timed_copy(*self._copy_bufs[nbytes])

    def _copy_buffers(self, nbytes: int):
        """(src on the prefill device, dst on the decode device) of ``nbytes``, copied once (first
        touch, peer-access setup) and synchronized."""
        import torch

        if self.cfg.device == "cuda":
            src = torch.ones(nbytes, dtype=torch.uint8, device=self.dev)
            dst = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", self.cfg.decode_device))
        else:
            src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        self._timed_copy(src, dst)
        return src, dst

    def _timed_copy(self, src, dst) -> float:
        """Seconds from ``dst.copy_(src)`` until the device has done it (nothing queued before it)."""
        import torch

        if self.cfg.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if self.cfg.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def warm_up(self, peer: str, repeat: int, notify: bool, rounds: int = 1) -> float:
        return self.pushers[ROWS["auto"]].warm_up(peer, 0, 0, repeat=repeat, notify=notify, rounds=rounds)

    def _plan(self, peer: str, local: list[int], remote: list[int], run_pages: Optional[int]):
        """Explicit descriptors of these pages to ``peer``, runs cut to ``run_pages`` (None: whole)."""
        from transfer import PageRuns, RegionSelection, descriptor_plan

        sel = RegionSelection.of(self.agent.table, self.book.get(peer).regions)
        return descriptor_plan(sel, PageRuns.of(local, remote).split(run_pages))

    def _wait_done(self, xfer, what: str) -> None:
        """Poll ``xfer`` in a tight loop until it ends; raise unless it completed."""
        while self.agent.state(xfer) == "PROC":
            pass
        if xfer.state != "DONE":
            raise RuntimeError(f"{what} WRITE failed")

    def write_pool(self, peer: str) -> float:
        """One WRITE of every pool page onto the same page of the peer (descriptors cut per
        ``--run-pages``); returns its seconds. Touches every page of both pools once."""
        pages = list(range(self.cfg.pool_pages))
        t0 = time.perf_counter()
        xfer = self.agent.write(peer, self._plan(peer, pages, pages, self.cfg.run_pages), b"")
        try:
            self._wait_done(xfer, "pool")
        finally:
            self.agent.release(xfer)
        return time.perf_counter() - t0

    def repost(self, peer: str, local: list[int], remote: list[int], reps: int) -> dict[str, Any]:
        """One request's WRITE (explicit descriptors, merged, no notification) posted once,
        then again ``reps`` times: seconds from posting to completion, each.

        The transport's own time for these bytes and descriptors: no planning,
        no request creation, no notification, no Pusher bookkeeping.
        """
        plan = self._plan(peer, local, remote, self.cfg.run_pages)
        xfer = self.agent.write(peer, plan, b"")
        times, posts = [], []
        try:
            for i in range(reps + 1):
                if i:
                    t0 = time.perf_counter()
                    self.agent.post(xfer)
                    posts.append(xfer.post_s)
                else:
                    t0 = time.perf_counter()
                self._wait_done(xfer, "raw")
                if i:
                    times.append(time.perf_counter() - t0)
        finally:
            self.agent.release(xfer)
        return {"seconds": statistics.median(times), "post_seconds": statistics.median(posts),
                "descriptors": plan.num_descriptors, "nbytes": plan.nbytes}

    def anatomy(self, peer: str, tokens: int, page_sets: list[tuple[list[int], list[int]]], reps: int,
                run_pages: list[Optional[int]]) -> dict[str, Any]:
        """Where one request's time goes: the same WRITE timed with one thing changed at a time.

        For each descriptor size in ``run_pages`` (None: whole runs) and each
        rep, interleaved, seconds from posting to DONE (``agent.state`` in a
        tight loop) of:
          ``repost``            a handle posted again (the transport alone);
          ``repost_notif``      the same with a notification;
          ``fresh``             a handle created before timing, posted once;
          ``fresh_notif``       the same with a notification;
          ``fresh_notif_new``   the same on pages not written just before;
          ``pusher``            `Pusher.push` then `Pusher.poll` until done
                                (the serving path; decode does not poll);
          ``pusher_*``          the same in parts: the push call, the copies
                                (the WRITE's state polled alone), the poll
                                that reports the end, and their total;
          ``release``, ``read_notifs``: releasing a done WRITE's handle, and
                                reading inbound notifications (once each).
        ``page_sets``: ``reps + 1`` (local, remote) page lists; the first is
        "the same pages". Returns ``{variant/run_pages: {median, min, post}}``.
        """
        from transfer import Pusher
        from transfer.messages import WarmUp, encode

        notif = encode(WarmUp())

        def plan(local, remote, rp):
            return self._plan(peer, local, remote, rp)

        def run(xfer, msg) -> tuple[float, float]:
            t0 = time.perf_counter()
            self.agent.post(xfer, msg)
            self._wait_done(xfer, "anatomy")
            return time.perf_counter() - t0, xfer.post_s

        same_l, same_r = page_sets[0]
        pushers = {rp: Pusher(self.agent, self.book, run_pages=rp) for rp in run_pages}
        held = {}
        for rp in run_pages:
            for name, msg in (("repost", b""), ("repost_notif", notif)):
                x = self.agent.prepare(peer, plan(same_l, same_r, rp))
                run(x, msg)  # its first post is not a repost
                held[(name, rp)] = (x, msg)
        times: dict[str, list[tuple[float, float]]] = {}
        variants = ("repost", "repost_notif", "fresh", "fresh_notif", "fresh_notif_new", "pusher")
        try:
            for i in range(reps):
                new_l, new_r = page_sets[1 + i]
                for rp in run_pages:
                    order = variants[i % len(variants):] + variants[:i % len(variants)]
                    for v in order:
                        key = f"{v}/{rp or 'whole'}"
                        if v in ("repost", "repost_notif"):
                            t = run(*held[(v, rp)])
                        elif v == "pusher":
                            p = pushers[rp]
                            rid = f"anatomy{i}-{rp}"
                            before = p.stats.copy()
                            p.begin(rid, peer, tokens, new_l, new_r, self.cfg.deadline_s)
                            t0 = time.perf_counter()
                            p.push(rid, tokens)
                            t1 = time.perf_counter()
                            while not (res := p.poll(spin_s=0.01)):
                                pass
                            t = (time.perf_counter() - t0, p.stats.since(before).post_s)
                            if not res[0].ok:
                                raise RuntimeError(f"anatomy: push failed: {res[0].reason}")
                            # The same split in parts: the push call; the copies (the WRITE's state
                            # polled alone); the poll that reports it.
                            rid = f"anatomy{i}-{rp}-parts"
                            p.begin(rid, peer, tokens, new_l, new_r, self.cfg.deadline_s)
                            t0 = time.perf_counter()
                            p.push(rid, tokens)
                            t1 = time.perf_counter()
                            while p.writes_in_flight():
                                pass
                            t2 = time.perf_counter()
                            while not (res := p.poll()):
                                pass
                            t3 = time.perf_counter()
                            for part, sec in (("push_call", t1 - t0), ("copies", t2 - t1), ("report", t3 - t2),
                                              ("parts_total", t3 - t0)):
                                times.setdefault(f"pusher_{part}/{rp or 'whole'}", []).append((sec, 0.0))
                        else:
                            pages = (new_l, new_r) if v == "fresh_notif_new" else (same_l, same_r)
                            x = self.agent.prepare(peer, plan(*pages, rp))
                            try:
                                t = run(x, b"" if v == "fresh" else notif)
                            finally:
                                t0 = time.perf_counter()
                                self.agent.release(x)
                                t1 = time.perf_counter()
                                self.agent.take()  # reads inbound notifications, as every poll does
                                t2 = time.perf_counter()
                            if v == "fresh_notif":
                                times.setdefault(f"release/{rp or 'whole'}", []).append((t1 - t0, 0.0))
                                times.setdefault(f"read_notifs/{rp or 'whole'}", []).append((t2 - t1, 0.0))
                        times.setdefault(key, []).append(t)
        finally:
            for x, _ in held.values():
                self.agent.release(x)
        return {k: {"median": statistics.median(a for a, _ in v), "min": min(a for a, _ in v),
                    "post": statistics.median(b for _, b in v)} for k, v in times.items()}

    def push(
        self, rid: str, peer: str, tokens: int, local: list[int], remote: list[int], path: str, merge: bool,
        chunk_tokens: int,
    ) -> dict[str, Any]:
        pusher = self.pushers[(path, merge)]
        before = pusher.stats.copy()
        chunk = chunk_tokens or tokens
        fenced = self.cfg.fenced
        running = self.cfg.forward_running
        if self._forward_copies and not running:
            self._forward()
        t0 = time.perf_counter()
        pusher.begin(rid, peer, tokens, local, remote, self.cfg.deadline_s)
        if running:
            # As served with an MTP layer: begin at admission, then the forward that writes the pages
            # (the MTP layer's, not waited for), then the fenced push while the device still runs it;
            # the WRITE is posted by the poll that sees the fence pass.
            self._forward(wait=False)
        self._fence_passed_at = None
        t_begun = time.perf_counter()
        done = 0
        while done < tokens:
            done = min(done + chunk, tokens)
            pusher.push(rid, done)
        t_posted = time.perf_counter()
        t_copied = None
        if self.cfg.lone_parts:  # the copies alone: the WRITEs' states in a tight loop, then the poll
            while pusher.writes_in_flight() and time.perf_counter() - t0 < self.cfg.deadline_s:
                pass
            t_copied = time.perf_counter()
        while True:
            results = pusher.poll(spin_s=0.01)  # as a prefill round waits for the prompts it finished
            if results:
                break
        t1 = time.perf_counter()
        (r,) = results
        st = pusher.stats.since(before)
        parts = {} if t_copied is None else {"push_call_seconds": t_posted - t_begun,
                                             "copies_seconds": t_copied - t_posted, "report_seconds": t1 - t_copied}
        if fenced:
            parts["from_fence_seconds"] = t1 - self._fence_passed_at
        return {**parts, "status": r.status.value, "reason": r.reason, "seconds": t1 - t0,
                "post_seconds": t_posted - t0, "from_push_seconds": t1 - t_begun, "push_at": t_begun,
                "plan_seconds": st.plan_s, "make_seconds": st.make_s, "nixl_post_seconds": st.post_s,
                "nbytes": r.nbytes, "descriptors": st.descriptors, "chunks": r.chunks}


    def push_stream(self, peer: str, reqs: list[tuple[str, int, list[int], list[int]]], inflight: int,
                    chunk_tokens: int) -> dict[str, Any]:
        """Push ``(request id, tokens, local pages, remote pages)`` back to back, at most ``inflight`` outstanding.

        The serving path (`Pusher` defaults). A request is posted as
        soon as a slot frees (its predecessor's WRITEs completed), so posting
        one request overlaps the copies of the others.
        """
        pusher = self.pushers[ROWS["auto"]]
        before = pusher.stats.copy()
        queue, active, results = list(reqs), set(), []
        t0 = time.perf_counter()
        while queue or active:
            while queue and len(active) < inflight:
                rid, tokens, local, remote = queue.pop(0)
                pusher.begin(rid, peer, tokens, local, remote, self.cfg.deadline_s)
                chunk, done = chunk_tokens or tokens, 0
                while done < tokens:
                    done = min(done + chunk, tokens)
                    pusher.push(rid, done)
                active.add(rid)
            for r in pusher.poll():
                active.discard(r.request_id)
                results.append(r)
        t1 = time.perf_counter()
        st = pusher.stats.since(before)
        failed = [f"{r.request_id}: {r.status.value} {r.reason}" for r in results if not r.ok]
        return {"seconds": t1 - t0, "nbytes": sum(r.nbytes for r in results), "requests": len(results),
                "descriptors": st.descriptors, "nixl_post_seconds": st.post_s, "failed": failed}


def _side_main(conn, role: str, cfg: BenchConfig) -> None:
    try:
        side = Side(role, cfg)
    except Exception as e:  # noqa: BLE001
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", None))
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            return
        if method == "exit":
            side.agent.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(side, method)(*args)))
        except Exception as e:  # noqa: BLE001
            conn.send(("err", f"{type(e).__name__}: {e}"))


class SideProc:
    def __init__(self, role: str, cfg: BenchConfig):
        ctx = mp.get_context("spawn")
        self.role = role
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_side_main, args=(child, role, cfg), daemon=True)
        self.proc.start()
        child.close()

    def recv(self, timeout_s: float = 600.0):
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"{self.role}: no reply in {timeout_s}s")
        tag, value = self.conn.recv()
        if tag == "err":
            raise RuntimeError(f"{self.role}: {value}")
        return value

    def send(self, method: str, *args) -> None:
        self.conn.send((method, args))

    def call(self, method: str, *args, timeout_s: float = 600.0):
        self.send(method, *args)
        return self.recv(timeout_s)

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("exit", timeout_s=30)
        except Exception:  # noqa: BLE001
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


# -- driver ------------------------------------------------------------------------


class Pair:
    def __init__(self, cfg: BenchConfig, seed: int):
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.pre = SideProc("prefill", cfg)
        self.dec = SideProc("decode", cfg)
        self.pre.recv()
        self.dec.recv()
        self.dec.call("accept", self.pre.call("respond", self.dec.call("offer")))
        self.pre_name, self.dec_name = self.pre.call("name"), self.dec.call("name")
        self.n = 0

    def request(self, tokens: int, path: str, merge: bool, chunk_tokens: int, verify: bool) -> dict[str, Any]:
        n = pages_for_tokens(tokens)
        local = page_ids(self.cfg.layout, n, self.cfg.pool_pages, self.rng)
        remote = page_ids(self.cfg.layout, n, self.cfg.pool_pages, self.rng)
        rid = f"req{self.n}"
        self.n += 1
        copy_alone = self.pre.call("copy_alone", n * self.cfg.bytes_per_page) if self.cfg.copy_alone else None
        self.dec.call("reserve", rid, self.pre_name, tokens, remote)
        self.dec.send("wait")
        res = self.pre.call("push", rid, self.dec_name, tokens, local, remote, path, merge, chunk_tokens)
        got = self.dec.recv()
        if res["status"] != "done" or got["status"] != "done":
            raise RuntimeError(f"request {rid} failed: push {res}, receive {got}")
        if verify and self.pre.call("checksum", local) != self.dec.call("checksum", remote):
            raise RuntimeError(f"request {rid}: decode pages differ from prefill pages")
        if copy_alone is not None:
            res["copy_alone_seconds"] = copy_alone
        res["receive_seconds"] = got["seconds"]
        res["to_decode_seconds"] = got["at"] - res["push_at"]
        return res

    def raw(self, tokens: int, reps: int) -> dict[str, Any]:
        """`Side.repost` of one request's pages (picked per ``--layout``)."""
        n = pages_for_tokens(tokens)
        local = page_ids(self.cfg.layout, n, self.cfg.pool_pages, self.rng)
        remote = page_ids(self.cfg.layout, n, self.cfg.pool_pages, self.rng)
        return self.pre.call("repost", self.dec_name, local, remote, reps)

    def anatomy(self, tokens: int, reps: int, run_pages: list[Optional[int]], decode_spins: bool) -> dict[str, Any]:
        """`Side.anatomy` on fresh page sets; ``decode_spins``: decode polls its receiver meanwhile."""
        n = pages_for_tokens(tokens)
        sets = [(page_ids(self.cfg.layout, n, self.cfg.pool_pages, self.rng),
                 page_ids(self.cfg.layout, n, self.cfg.pool_pages, self.rng)) for _ in range(reps + 1)]
        if decode_spins:
            self.dec.send("spin", 0.5 + 0.05 * reps * len(run_pages))
            time.sleep(0.05)
        res = self.pre.call("anatomy", self.dec_name, tokens, sets, reps, run_pages)
        if decode_spins:
            self.dec.recv()
        return res

    def stream(self, tokens: int, inflight: int, count: int, chunk_tokens: int, verify: bool) -> dict[str, Any]:
        """``count`` requests of ``tokens`` pushed with at most ``inflight`` outstanding.

        Request i uses slot i % inflight: every slot has its own decode pages
        (and prefill pages), disjoint from the other slots', scattered per
        ``--layout``, so outstanding requests never share a page.
        """
        n = pages_for_tokens(tokens)
        pool = self.cfg.pool_pages
        local_ids = page_ids(self.cfg.layout, inflight * n, pool, self.rng)
        remote_ids = page_ids(self.cfg.layout, inflight * n, pool, self.rng)
        slots = [(local_ids[k * n:(k + 1) * n], remote_ids[k * n:(k + 1) * n]) for k in range(inflight)]
        reqs = []
        for i in range(count):
            local, remote = slots[i % inflight]
            reqs.append((f"req{self.n}", tokens, local, remote))
            self.n += 1
        self.dec.call("reserve_many", [(rid, self.pre_name, t, remote) for rid, t, _, remote in reqs])
        self.dec.send("wait_many", count)
        res = self.pre.call("push_stream", self.dec_name, reqs, inflight, chunk_tokens)
        got = self.dec.recv()
        if res["failed"] or got != {"done": count}:
            raise RuntimeError(f"stream of {count} x {tokens} tok failed: push {res['failed']}, receive {got}")
        if verify:
            # Each slot's last request is the one its pages hold now.
            for local, remote in slots:
                if self.pre.call("checksum", local) != self.dec.call("checksum", remote):
                    raise RuntimeError("stream: decode pages differ from prefill pages")
        return res

    def close(self) -> None:
        self.pre.close()
        self.dec.close()


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


ROWS = {"auto": ("auto", True), "prep": ("prepared", True), "flat": ("prepared", False), "init": ("explicit", True)}
"""Warm rows by name: `Pusher` (path, merge). auto: the serving default; prep / flat: prepared
descriptor lists with / without merging; init: explicit descriptors (one per region and page run)."""


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


LONE_EXTRAS = ("from_fence_seconds", "copy_alone_seconds")
"""What `--fenced` / `--copy-alone` add to a request alone."""


def lone_extras(r: dict[str, Any], copy_s: float) -> str:
    """`--fenced`: the push from its fence passing; `--copy-alone`: the torch copy timed alone, and
    the push (from the push call, or the fence) as a fraction of it. Empty if neither was run."""
    out = []
    if "from_fence_seconds" in r:
        out.append(f"from the fence passing {ms(r['from_fence_seconds'])} ms = "
                   f"{copy_s / r['from_fence_seconds']:.3f} of copy")
    if "copy_alone_seconds" in r:
        lone = r["copy_alone_seconds"]
        push = r.get("from_fence_seconds", r["from_push_seconds"])
        out.append(f"torch copy alone {ms(lone)} ms = {copy_s / lone:.3f} of the copy back to back; the push = "
                   f"{lone / push:.3f} of the copy alone")
    return "; ".join(out)


def run_mode(cfg: BenchConfig, args, tokens: list[int], copy_s: Optional[dict[int, float]], verify: bool,
             header: bool) -> tuple[dict[str, Any], dict[int, float]]:
    """One pair of processes with ``cfg.ucx_sgl``: reference copy (if not given), warm-up, first request, rows."""
    pair = Pair(cfg, args.seed)
    try:
        info = pair.pre.call("info")
        if header:
            dec_info = pair.dec.call("info")
            print(f"# transfer bench: NIXL WRITE push, prefill process -> decode process ({args.device})")
            if args.device == "cuda":
                print(f"# gpu: {info['gpu']} (prefill cuda:{cfg.prefill_device}) -> {dec_info['gpu']} (decode "
                      f"cuda:{cfg.decode_device}); {info['gpu_count']} visible")
                print(f"# versions: torch {info['torch']}, CUDA {info['cuda']}, nixl {info['nixl']}; "
                      f"{info['host_cpus']} host CPUs")
            else:
                print(f"# cpu: {info['cpu']}, torch threads {info['threads']}")
                print(f"# versions: torch {info['torch']}, nixl {info['nixl']}")
            print(f"# geometry: {cfg.layers} layers x ({cfg.mla_bytes} MLA + {cfg.index_bytes} index) B/page = "
                  f"{cfg.bytes_per_page / 1e6:.3f} MB/page; cache {cfg.cache_layout} "
                  f"({ {'cross-layer': 1, 'per-layer': cfg.layers}.get(cfg.cache_layout, 2 * cfg.layers)} region(s), "
                  f"run pages {cfg.run_pages or 'whole runs'}); "
                  f"pool {cfg.pool_pages} pages/side; page ids {cfg.layout}; "
                  f"chunk {args.chunk_tokens or 'whole prompt'}; device busy before a lone push "
                  f"{cfg.forward_ms or 'no'} ms{' (still running at the push)' if cfg.forward_running else ''}; "
                  f"push {f'fenced ({cfg.fence_kind})' if cfg.fenced else 'not fenced'}; "
                  f"NIXL progress thread "
                  f"{('on' if cfg.prefill_progress_thread else 'decode only') if cfg.progress_thread else 'off'}; UCX threads {cfg.ucx_threads}; UCX backend params "
                  f"{dict(cfg.backend_params) or 'default'}; UCX env "
                  f"{ {k: v for k, v in os.environ.items() if k.startswith('UCX_')} or 'default'}")
        if copy_s is None:
            copy_s = {t: pair.pre.call("copy_reference", pages_for_tokens(t) * cfg.bytes_per_page, max(args.reps, 3))
                      for t in tokens}
            for t in tokens:
                nb = pages_for_tokens(t) * cfg.bytes_per_page
                print(f"reference torch copy {t:>6} tok: {nb / 1e6:9.1f} MB in {copy_s[t] * 1e3:8.2f} ms = "
                      f"{gbps(nb, copy_s[t]):7.1f} GB/s")
        sgl = "on" if cfg.ucx_sgl else "off"
        print(f"## UCX scatter-gather offload {sgl} (fresh pair: {pair.pre_name} -> {pair.dec_name})")
        out: dict[str, Any] = {"ucx_sgl": cfg.ucx_sgl, "info": info}
        warm_s = None
        if args.warmup:
            warm_s = pair.pre.call("warm_up", pair.dec_name, args.warmup_repeat, args.warmup_notif == "on",
                                   args.warmup_rounds)
            print(f"warm-up at start ({args.warmup_rounds} x {args.warmup_repeat} x one page per region, notification "
                  f"{args.warmup_notif}): {warm_s * 1e3:.1f} ms")
        out["warmup_seconds"] = warm_s
        if args.warmup_pool:
            pool_s = pair.pre.call("write_pool", pair.dec_name)
            print(f"warm-up: every pool page written once ({cfg.pool_pages} pages): {pool_s * 1e3:.1f} ms")

        first = pair.request(tokens[0], *ROWS["auto"], args.chunk_tokens, verify)
        f_bw = gbps(first["nbytes"], first["seconds"])
        print(f"first request after start ({'warmed' if args.warmup else 'cold'}), {tokens[0]} tok, serving path: "
              f"{first['seconds'] * 1e3:.2f} ms = {f_bw:.1f} GB/s = {f_bw / gbps(first['nbytes'], copy_s[tokens[0]]):.3f}"
              f" of copy (post {ms(first['post_seconds'])} ms: plan {ms(first['plan_seconds'])}, make "
              f"{ms(first['make_seconds'])}, nixl_post {ms(first['nixl_post_seconds'])}); from the push call "
              f"{ms(first['from_push_seconds'])} ms = {copy_s[tokens[0]] / first['from_push_seconds']:.3f} of copy; "
              f"to decode {ms(first['to_decode_seconds'])} ms = {copy_s[tokens[0]] / first['to_decode_seconds']:.3f}")
        extra = lone_extras(first, copy_s[tokens[0]])
        if extra:
            print(f"  first request: {extra}")
        first["fraction_of_copy"] = f_bw / gbps(first["nbytes"], copy_s[tokens[0]])
        first["fraction_from_push"] = copy_s[tokens[0]] / first["from_push_seconds"]
        first["fraction_to_decode"] = copy_s[tokens[0]] / first["to_decode_seconds"]
        out["first"] = first

        print(f"{'tokens':>6} {'path':>4} {'merge':>5} {'descs':>7} {'MB':>9} {'plan_ms':>8} {'make_ms':>8} "
              f"{'nixl_post_ms':>12} {'post_ms':>8} {'push_ms':>9} {'GB/s':>8} {'fraction_of_copy':>16} "
              f"{'from_push_ms':>12} {'fraction':>8} {'to_decode_ms':>12} {'fraction':>8}")
        rows = []
        for t in tokens:
            for name in args.row_names:
                path, merge = ROWS[name]
                runs = [pair.request(t, path, merge, args.chunk_tokens, verify and i == 0) for i in range(args.reps)]
                med = {k: statistics.median(r[k] for r in runs)
                       for k in ("seconds", "post_seconds", "plan_seconds", "make_seconds", "nixl_post_seconds",
                                 "from_push_seconds", "to_decode_seconds")}
                nb = runs[0]["nbytes"]
                bw = gbps(nb, med["seconds"])
                frac = bw / gbps(nb, copy_s[t])
                print(f"{t:>6} {name:>4} {'yes' if merge else 'no':>5} {runs[0]['descriptors']:>7} {nb / 1e6:>9.1f} "
                      f"{ms(med['plan_seconds']):>8} {ms(med['make_seconds']):>8} {ms(med['nixl_post_seconds']):>12} "
                      f"{ms(med['post_seconds']):>8} {ms(med['seconds']):>9} {bw:>8.1f} {frac:>16.3f} "
                      f"{ms(med['from_push_seconds']):>12} {copy_s[t] / med['from_push_seconds']:>8.3f} "
                      f"{ms(med['to_decode_seconds']):>12} {copy_s[t] / med['to_decode_seconds']:>8.3f}")
                extra = {k: statistics.median(r[k] for r in runs) for k in LONE_EXTRAS if k in runs[0]}
                if extra:
                    print(f"  {t} alone (median): "
                          f"{lone_extras({**extra, 'from_push_seconds': med['from_push_seconds']}, copy_s[t])}")
                part = dict(extra)
                if cfg.lone_parts:
                    part.update({k: statistics.median(r[k] for r in runs)
                                 for k in ("push_call_seconds", "copies_seconds", "report_seconds")})
                    print(f"  parts of {t} alone (median): push call {ms(part['push_call_seconds'])} ms, copies "
                          f"{ms(part['copies_seconds'])} ms, reporting poll {ms(part['report_seconds'])} ms")
                rows.append({**part, "tokens": t, "path": name, "merge": merge, "ucx_sgl": cfg.ucx_sgl,
                             "descriptors": runs[0]["descriptors"], "nbytes": nb, "push_seconds": med["seconds"],
                             "post_seconds": med["post_seconds"], "plan_seconds": med["plan_seconds"],
                             "make_seconds": med["make_seconds"], "nixl_post_seconds": med["nixl_post_seconds"],
                             "gbps": bw, "copy_seconds": copy_s[t], "fraction_of_copy": frac,
                             "from_push_seconds": med["from_push_seconds"],
                             "fraction_from_push": copy_s[t] / med["from_push_seconds"],
                             "to_decode_seconds": med["to_decode_seconds"],
                             "fraction_to_decode": copy_s[t] / med["to_decode_seconds"]})
        out["rows"] = rows
        out["raw"] = []
        if args.raw_reps:
            print(f"raw: one request's WRITE posted again {args.raw_reps} times (median; no plan, no request "
                  f"creation, no notification)")
            for t in tokens:
                r = pair.raw(t, args.raw_reps)
                bw = gbps(r["nbytes"], r["seconds"])
                frac = bw / gbps(r["nbytes"], copy_s[t])
                print(f"raw {t:>6} tok: {r['descriptors']} descs, post {ms(r['post_seconds'])} ms, WRITE "
                      f"{ms(r['seconds'])} ms = {bw:.1f} GB/s = {frac:.3f} of copy")
                out["raw"].append({"tokens": t, **r, "gbps": bw, "copy_seconds": copy_s[t], "fraction_of_copy": frac})
        out["streams"] = []
        if args.inflight:
            count = args.stream or 4 * args.inflight
            print(f"stream: {count} requests back to back, at most {args.inflight} outstanding, serving path "
                  f"(median of {args.stream_reps})")
            print(f"{'tokens':>6} {'inflight':>8} {'requests':>8} {'descs/req':>9} {'MB/req':>8} {'nixl_post_ms':>12} "
                  f"{'stream_ms':>9} {'GB/s':>8} {'fraction_of_copy':>16}")
            for t in tokens:
                runs = [pair.stream(t, args.inflight, count, args.chunk_tokens, verify and i == 0)
                        for i in range(args.stream_reps)]
                sec = statistics.median(r["seconds"] for r in runs)
                post = statistics.median(r["nixl_post_seconds"] for r in runs)
                nb = runs[0]["nbytes"]
                bw = gbps(nb, sec)
                copy_bw = gbps(pages_for_tokens(t) * cfg.bytes_per_page, copy_s[t])
                print(f"{t:>6} {args.inflight:>8} {count:>8} {runs[0]['descriptors'] // count:>9} "
                      f"{nb / count / 1e6:>8.1f} {ms(post):>12} {ms(sec):>9} {bw:>8.1f} {bw / copy_bw:>16.3f}")
                out["streams"].append({"tokens": t, "inflight": args.inflight, "requests": count,
                                       "ucx_sgl": cfg.ucx_sgl, "descriptors": runs[0]["descriptors"], "nbytes": nb,
                                       "stream_seconds": sec, "nixl_post_seconds": post, "gbps": bw,
                                       "copy_seconds": copy_s[t], "fraction_of_copy": bw / copy_bw})
        out["anatomy"] = []
        if args.anatomy_reps:
            t = tokens[0]
            rps = [int(x) or None for x in args.anatomy_run_pages.split(",")]
            print(f"anatomy of one {t}-token request (median / min of {args.anatomy_reps}, ms from posting to DONE; "
                  f"fraction of copy from the median):")
            for spins in (False, True):
                res = pair.anatomy(t, args.anatomy_reps, rps, spins)
                for key, r in res.items():
                    print(f"anat decode {'polls' if spins else 'idle ':5} {key:>22}: {ms(r['median'])} / "
                          f"{ms(r['min'])} ms, post {ms(r['post'])} ms, {copy_s[t] / r['median']:.3f} of copy")
                    out["anatomy"].append({"tokens": t, "decode_polls": spins, "variant": key, **r,
                                           "fraction_of_copy": copy_s[t] / r["median"]})
        return out, copy_s
    finally:
        pair.close()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--devices", default="0,0", help="prefill,decode CUDA ordinals (default 0,0: two processes on one GPU)")
    ap.add_argument("--tokens", default="8192,32768", help="prompt lengths, comma-separated")
    ap.add_argument("--layers", type=int, default=DSV32_LAYERS)
    ap.add_argument("--mla-bytes", type=int, default=DSV32_MLA_BYTES)
    ap.add_argument("--index-bytes", type=int, default=DSV32_INDEX_BYTES)
    ap.add_argument("--layout", choices=("contiguous", "runs", "random"), default="runs",
                    help="how page ids are scattered in both pools (default runs: 1-16 consecutive pages)")
    ap.add_argument("--cache-layout", choices=("per-layer", "cross-layer", "layer-major"), default="per-layer",
                    help="per-layer (default): a region per layer, MLA then indexer bytes per page; "
                         "cross-layer: one region whose page holds every layer's MLA + indexer bytes "
                         "(one descriptor per page run); layer-major: a region per (layer, kind), the pool "
                         "before session 4")
    ap.add_argument("--run-pages", type=int, default=None,
                    help="cut page runs into descriptors of at most this many pages (default: whole runs)")
    ap.add_argument("--inflight", type=int, default=0,
                    help="also push a stream of requests with up to N outstanding and report aggregate GB/s")
    ap.add_argument("--stream", type=int, default=0, help="requests per stream (default 4 x --inflight)")
    ap.add_argument("--stream-reps", type=int, default=3, help="streams per configuration (median)")
    ap.add_argument("--paths", default="auto,prep,init",
                    help="warm rows to run, comma-separated: auto (the serving default), prep (prepared lists, "
                         "merged), flat (prepared, not merged), init (explicit descriptors, merged); empty: none")
    ap.add_argument("--raw-reps", type=int, default=0,
                    help="also post one request's WRITE again this many times (no planning, request creation "
                         "or notification): the transport's own time, per token count")
    ap.add_argument("--anatomy-reps", type=int, default=0,
                    help="also time one request of the first --tokens with one thing changed at a time "
                         "(re-posted / fresh handle, notification, new pages, Pusher), this many reps each, "
                         "with decode idle and polling")
    ap.add_argument("--anatomy-run-pages", default="16,0",
                    help="descriptor sizes (pages) the anatomy compares, comma-separated; 0: whole runs")
    ap.add_argument("--chunk-tokens", type=int, default=0, help="push in chunks of this many tokens (0: one chunk)")
    ap.add_argument("--reps", type=int, default=5, help="warm repetitions per configuration (median)")
    ap.add_argument("--warmup", action="store_true", help="warm the pair up at start (connect + one page per region)")
    ap.add_argument("--warmup-notif", choices=("on", "off"), default="on",
                    help="attach a notification to the warm-up WRITE (default on, as served)")
    ap.add_argument("--warmup-rounds", type=int, default=3,
                    help="warm-up WRITEs at start, one after the other (default 3, as served)")
    ap.add_argument("--warmup-pool", action="store_true",
                    help="after the warm-up, WRITE every pool page once (not timed as a request)")
    ap.add_argument("--warmup-repeat", type=int, default=32,
                    help="the warm-up writes its page this many times per region in one WRITE (default 32)")
    ap.add_argument("--ucx-sgl", choices=("off", "on", "both"), default="both",
                    help="NIXL's UCX scatter-gather offload (NIXL_UCX_SGL_ENABLE): off, on, or both in turn "
                         "(a fresh pair each; default both)")
    ap.add_argument("--ucx-threads", type=int, default=0, help="NIXL UCX posting threads (num_threads; default 0)")
    ap.add_argument("--ucx-param", action="append", default=[], metavar="KEY=VALUE",
                    help="NIXL UCX backend init parameter (num_workers, split_batch_size, ...); repeatable")
    ap.add_argument("--receiver-defaults", action="store_true",
                    help="the UCX settings above apply to the prefill (pushing) agent only")
    ap.add_argument("--no-verify", action="store_true", help="skip the page checksum comparison")
    ap.add_argument("--deadline", type=float, default=120.0, help="per-request deadline, seconds")
    ap.add_argument("--no-progress-thread", action="store_true",
                    help="create the NIXL agents without their spinning progress thread")
    ap.add_argument("--no-prefill-progress-thread", action="store_true",
                    help="only the decode agent runs NIXL's progress thread (the pushing side progresses "
                         "its UCX worker when it polls its WRITEs)")
    ap.add_argument("--forward-ms", type=float, default=0.0,
                    help="before each request alone (and the first), keep the prefill device busy this long (copies "
                         "of a scratch buffer), as the forward that wrote the pages would; default 0: idle since "
                         "the last request")
    ap.add_argument("--lone-parts", action="store_true",
                    help="time each request alone in parts too: the push call, the copies (the WRITEs' states "
                         "polled alone), the poll that reports the end")
    ap.add_argument("--fenced", action="store_true",
                    help="push as served: each push is fenced (workers.kv_link.cuda_event_fence: a CUDA event; the "
                         "WRITE is posted by the poll that sees it pass); a request alone is then also timed from "
                         "the fence passing")
    ap.add_argument("--fence-kind", choices=("served", "event", "query", "sync"), default="served",
                    help="with --fenced: served (workers.kv_link.cuda_event_fence), event (always a CUDA event "
                         "recorded at the push, as served before session 8), query (no event if the stream is "
                         "idle, else an event: served since session 8), sync (the push waits for the stream)")
    ap.add_argument("--forward-running", action="store_true",
                    help="with --fenced and --forward-ms: push while that device work still runs (as served after "
                         "the MTP layer's forward), not once it ran")
    ap.add_argument("--copy-alone", action="store_true",
                    help="before each request alone, time a torch copy of its bytes alone the same way (the "
                         "prefill process comes out of a pipe read): the reference for a lone request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)

    tokens = [int(t) for t in args.tokens.split(",")]
    pre_dev, dec_dev = (int(x) for x in args.devices.split(","))
    args.row_names = [p for p in args.paths.split(",") if p]
    if unknown := [p for p in args.row_names if p not in ROWS]:
        ap.error(f"--paths: unknown {unknown}; known: {', '.join(ROWS)}")
    if args.fenced and args.lone_parts:
        ap.error("--lone-parts times the push call's own post: not with --fenced (the poll may post)")
    if args.forward_running and not (args.fenced and args.forward_ms > 0):
        ap.error("--forward-running needs --fenced and --forward-ms (an unfenced push would read pages "
                 "still being written)")
    if args.inflight < 0 or args.stream < 0:
        ap.error("--inflight and --stream must be >= 0")
    # Every outstanding request of a stream has its own pages.
    max_pages = pages_for_tokens(max(tokens)) * max(1, args.inflight)
    pool = max_pages if args.layout == "contiguous" else max_pages + max_pages // 4 + 16
    base = BenchConfig(args.device, pre_dev, dec_dev, args.layers, args.mla_bytes, args.index_bytes, pool,
                       args.layout, args.deadline, not args.no_progress_thread, ucx_threads=args.ucx_threads,
                       cache_layout=args.cache_layout, run_pages=args.run_pages,
                       backend_params=tuple(tuple(kv.split("=", 1)) for kv in args.ucx_param),
                       receiver_defaults=args.receiver_defaults,
                       prefill_progress_thread=not args.no_prefill_progress_thread, forward_ms=args.forward_ms,
                       lone_parts=args.lone_parts, fenced=args.fenced,
                       forward_running=args.forward_running, copy_alone=args.copy_alone,
                       fence_kind=args.fence_kind)
    verify = not args.no_verify
    sgl_modes = {"off": [False], "on": [True], "both": [False, True]}[args.ucx_sgl]

    report: dict[str, Any] = {"config": asdict(base), "tokens": tokens, "modes": [], "rows": [], "streams": [],
                              "raw": []}
    copy_s = None
    for k, sgl in enumerate(sgl_modes):
        cfg = dataclasses.replace(base, ucx_sgl=sgl)
        mode, copy_s = run_mode(cfg, args, tokens, copy_s, verify, header=k == 0)
        report["modes"].append(mode)
        report["rows"] += mode["rows"]
        report["streams"] += mode["streams"]
        report["raw"] += mode["raw"]
    report["info"] = report["modes"][0]["info"]
    report["copy_seconds"] = {str(t): s for t, s in copy_s.items()}
    if verify:
        print("verified: decode pages equal prefill pages (per-region checksums)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
