"""A replica's end of the prefill → decode KV link: its NIXL agent over every
cache region, its peer book, and the compatibility info both ends hash."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from attention.cache import PagedKVCache
from attention.formats import PAGE_SIZE
from transfer import CompatInfo, PeerBook, Pusher, Receiver, TransferAgent


def compat_info(model_dir: str | Path, cache: PagedKVCache, has_mtp: bool) -> CompatInfo:
    """What prefill and decode must agree on, from the checkpoint config and
    the cache geometry (``model``: sha256 of the canonical config.json)."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    ident = hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:16]
    spec = cache.spec
    if spec.kv_cache_dtype == "fp8":
        kv, index = f"fp8_mla_{spec.mla_format.bytes_per_token}", f"fp8_index_{spec.index_format.bytes_per_token}"
    else:
        dt = str(spec.dtype).replace("torch.", "")
        kv = f"{dt}_mla_{spec.kv_lora_rank + spec.rope_dim}"
        index = f"{dt}_index_{spec.index_head_dim}"
    return CompatInfo(model=f"{raw.get('model_type', '?')}:{ident}", num_layers=spec.num_layers,
                      page_size=PAGE_SIZE, kv_format=kv, index_format=index, has_mtp=has_mtp)


@dataclass
class KVLink:
    agent: TransferAgent
    peers: PeerBook

    @classmethod
    def create(cls, worker_id: str, model_dir: str | Path, cache: PagedKVCache, has_mtp: bool,
               epoch: int | None = None) -> "KVLink":
        """``epoch``: None for a fresh one; the ranks of a tensor-parallel replica share one."""
        # UCX scatter-gather offload batches the per-descriptor cuda_ipc copies:
        # 2.5x the push throughput on the H100 (docs/perf.md). On DRAM UCX only
        # emulates it, so it stays off there.
        on_gpu = cache.regions()[0].tensor.is_cuda
        agent = TransferAgent(worker_id, cache.regions(), compat_info(model_dir, cache, has_mtp),
                              ucx_sgl=True if on_gpu else None, epoch=epoch)
        return cls(agent, PeerBook(agent))

    def pusher(self) -> Pusher:
        """The prefill side's pusher over this link (a rank group's link makes one over its ranks)."""
        return Pusher(self.agent, self.peers)

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
