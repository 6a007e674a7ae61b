"""A replica's end of the prefill → decode KV link: its NIXL agent over every
cache region, its peer book, and the compatibility info both ends hash."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from attention.cache import PagedKVCache
from attention.group_cache import UNIT_BYTES, GroupedPagedCache
from attention.formats import PAGE_SIZE
from models.config import config_identity
from transfer import CompatInfo, PeerBook, Pusher, Receiver, TransferAgent
from workers.push_tuning import PushTuning, gpu_push_tuning


def compat_info(model_dir: str | Path, cache: PagedKVCache, has_mtp: bool) -> CompatInfo:
    """What prefill and decode must agree on, from the checkpoint config (``model``:
    `models.config.config_identity`) and the cache geometry."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if isinstance(cache, GroupedPagedCache):
        # Cache groups (DeepSeek-V4): every group's geometry and format is in state_formats; the one
        # region's page is a transfer unit (attention.group_cache).
        n = max(layer for g in cache.groups for layer in g.layers) + 1
        return CompatInfo(model=config_identity(raw), num_layers=n, page_size=UNIT_BYTES, kv_format="groups",
                          index_format="groups", has_mtp=has_mtp, state_formats=cache.formats())
    spec = cache.spec
    kv, index = spec.transfer_formats()
    return CompatInfo(model=config_identity(raw), num_layers=spec.num_layers,
                      page_size=PAGE_SIZE, kv_format=kv, index_format=index, has_mtp=has_mtp)


def device_fence(cache: PagedKVCache) -> Callable[[], Callable[[], bool]] | None:
    """`transfer.Pusher`'s ``fence`` for pages of ``cache``: `cuda_event_fence` of its device on a
    CUDA cache; None on CPU, where a forward has written its pages when it returns."""
    tensor = cache.regions()[0].tensor
    return cuda_event_fence(tensor.device) if tensor.is_cuda else None


def cuda_event_fence(device: torch.device) -> Callable[[], Callable[[], bool]]:
    """A fence for pages written on ``device``'s current stream (where the forwards write them).
    NIXL copies on UCX's own stream, which would otherwise read pages still being written; the
    pusher posts once the fence passes, so no thread waits for the device.

    If the stream has nothing left to run, the pages are written and the fence has passed, with no
    event. Else it records one and returns its ``query`` (a chunk whose forward still runs). An
    event on an idle stream would pass only once the device reached it: on the H100 a lone 8k-token
    push from the push call reached 0.58-0.62 of a device copy fenced that way, 0.62-0.72 asking the
    stream first, 0.68-0.82 unfenced (interleaved in one call; docs/perf.md, session 8). A caller
    that knows the pages are written (`workers.prefill_worker`, after reading a first token back)
    takes no fence at all (``Pusher.push(..., written=True)``)."""

    def fence() -> Callable[[], bool]:
        stream = torch.cuda.current_stream(device)
        if stream.query():
            return _written
        event = torch.cuda.Event()
        event.record(stream)
        return event.query

    return fence


def _written() -> bool:
    return True


@dataclass
class KVLink:
    agent: TransferAgent
    peers: PeerBook
    push: PushTuning = PushTuning()
    fence: Callable[[], Callable[[], bool]] | None = None

    @classmethod
    def create(cls, worker_id: str, model_dir: str | Path, cache: PagedKVCache, has_mtp: bool,
               epoch: int | None = None, push: PushTuning = PushTuning()) -> "KVLink":
        """``epoch``: None for a fresh one; the ranks of a tensor-parallel replica share one.
        ``push``: posting threads (GPU caches only), descriptor size, and whether this link pushes
        (`PushTuning.for_prefill`)."""
        on_gpu = cache.regions()[0].tensor.is_cuda
        tuning = gpu_push_tuning(push.threads, push.pushes) if on_gpu else {}
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
