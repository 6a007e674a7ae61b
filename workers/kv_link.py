"""A replica's end of the prefill → decode KV link: its NIXL agent over every
cache region, its peer book, and the compatibility info both ends hash."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from attention.cache import PagedKVCache
from attention.formats import PAGE_SIZE
from models.config import config_identity
from transfer import CompatInfo, PeerBook, Pusher, Receiver, TransferAgent


def compat_info(model_dir: str | Path, cache: PagedKVCache, has_mtp: bool) -> CompatInfo:
    """What prefill and decode must agree on, from the checkpoint config (``model``:
    `models.config.config_identity`) and the cache geometry."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    spec = cache.spec
    kv, index = spec.transfer_formats()
    return CompatInfo(model=config_identity(raw), num_layers=spec.num_layers,
                      page_size=PAGE_SIZE, kv_format=kv, index_format=index, has_mtp=has_mtp)


# NIXL / UCX settings of an agent whose cache is in GPU memory. UCX's
# cuda_ipc issues every copy to one peer GPU from one UCX worker on one CUDA
# stream; splitting each WRITE over N posting threads on N UCX workers gives it
# N streams. Streams of 32k-token DeepSeek-V3.2 requests, 8 in flight
# (docs/perf.md, session 4), 8 threads: one H100 0.997-0.999 of a device copy
# (one thread with scatter-gather offload, the previous setting: 0.55); 2 x H200
# 0.94-0.96 of a peer copy (previous setting: 0.62). 16 threads measured worse
# on the H100 (0.58), 2 and 4 slower for single requests. CPU (DRAM) agents
# keep NIXL's defaults (UCX only emulates scatter-gather there).
DEFAULT_PUSH_THREADS = 8

# A cross_layer cache pushes a request's run of pages as one descriptor unless
# it is cut: 16-page descriptors (49 MB of DeepSeek-V3.2 pages) spread an 8k
# request over 8 posting threads, and NIXL splits a WRITE of as few as one
# descriptor (split_batch_size 1). With that, 2 x H200: 8k requests 0.89-0.91 of
# a peer copy alone and 0.98-1.02 streamed (0.80 / 0.86 on the per_layer cache);
# one H100: 0.69 / 0.77-0.99 (per_layer 0.64-0.69 / 0.71-0.78). docs/perf.md, session 5.
DEFAULT_DESCRIPTOR_PAGES = 16


def gpu_push_tuning(threads: int | None = None) -> dict:
    """`TransferAgent` keyword arguments for a GPU cache: ``threads`` posting
    threads on as many UCX workers (None: `DEFAULT_PUSH_THREADS`); 0: one
    thread with UCX scatter-gather offload."""
    threads = DEFAULT_PUSH_THREADS if threads is None else int(threads)
    if threads < 0:
        raise ValueError(f"push threads must be >= 0, got {threads}")
    if threads == 0:
        return {"ucx_sgl": True}
    # split_batch_size 1: a WRITE of any number of descriptors is spread over the threads
    # (NIXL's default, 1024, would post a cross_layer request's few descriptors from one).
    return {"ucx_sgl": False,
            "backend_params": {"num_threads": str(threads), "num_workers": str(threads), "split_batch_size": "1"}}


@dataclass(frozen=True)
class PushTuning:
    """How a KV link pushes (``transfer`` in a serve config).

    ``threads``: NIXL posting threads of a GPU agent (`gpu_push_tuning`; None:
    `DEFAULT_PUSH_THREADS`). ``descriptor_pages``: most pages per descriptor
    (`transfer.Pusher`'s ``run_pages``; None: whole runs).
    """

    threads: int | None = None
    descriptor_pages: int | None = DEFAULT_DESCRIPTOR_PAGES

    def __post_init__(self) -> None:
        if self.descriptor_pages is not None and self.descriptor_pages < 1:
            raise ValueError(f"descriptor_pages must be >= 1 or None, got {self.descriptor_pages!r}")


def device_fence(cache: PagedKVCache) -> Callable[[], None] | None:
    """What a pusher calls before posting pages of ``cache`` (`transfer.Pusher`'s ``fence``):
    for a CUDA cache, wait until the device has run every kernel queued so far, since NIXL
    copies on UCX's own stream and would otherwise read pages still being written. None on CPU,
    where a forward has written its pages when it returns."""
    tensor = cache.regions()[0].tensor
    if not tensor.is_cuda:
        return None
    device = tensor.device
    return lambda: torch.cuda.synchronize(device)


@dataclass
class KVLink:
    agent: TransferAgent
    peers: PeerBook
    push: PushTuning = PushTuning()
    fence: Callable[[], None] | None = None

    @classmethod
    def create(cls, worker_id: str, model_dir: str | Path, cache: PagedKVCache, has_mtp: bool,
               epoch: int | None = None, push: PushTuning = PushTuning()) -> "KVLink":
        """``epoch``: None for a fresh one; the ranks of a tensor-parallel replica share one.
        ``push``: posting threads (GPU caches only) and descriptor size."""
        on_gpu = cache.regions()[0].tensor.is_cuda
        tuning = gpu_push_tuning(push.threads) if on_gpu else {}
        agent = TransferAgent(worker_id, cache.regions(), compat_info(model_dir, cache, has_mtp), epoch=epoch,
                              **tuning)
        return cls(agent, PeerBook(agent), push, device_fence(cache))

    def pusher(self) -> Pusher:
        """The prefill side's pusher over this link (a rank group's link makes one over its ranks)."""
        return Pusher(self.agent, self.peers, run_pages=self.push.descriptor_pages, fence=self.fence)

    def receiver(self, release_pages) -> Receiver:
        """The decode side's receiver; ``release_pages(page_ids)`` gets back pages of a request that ended
        without its KV, once no prefill WRITE can land in them."""
        return Receiver(self.agent, self.peers, release_pages=release_pages)

    def handshake(self, other: "KVLink") -> None:
        """Both directions (in-process pair): each side checks and loads the other's offer."""
        reply = other.peers.respond(self.peers.offer().to_bytes())
        self.peers.accept(reply)

    def close(self) -> None:
        self.agent.close()
