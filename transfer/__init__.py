"""NIXL transfer of KV / indexer / state pages from prefill to decode (DESIGN.md, request path 3-5).

Layering: imports `attention` (page geometry) only; nothing about models or Ray.

    agent = TransferAgent(worker_id, cache.regions(), compat)   # registers every region once
    book = PeerBook(agent)                                      # handshake: offer / respond / accept
    Pusher(agent, book)     # prefill: begin / push per chunk / poll -> PushResult
    Receiver(agent, book, release_pages=pool.free)   # decode: expect / poll -> ReceiveResult;
                            # pages of failed requests come back only once no WRITE can land
"""

from transfer.agent import TransferAgent
from transfer.compat import CompatInfo
from transfer.errors import (
    CompatibilityError,
    FieldDiff,
    PlanError,
    RegionError,
    RequestCancelledError,
    StaleEpochError,
    TransferError,
    UnknownPeerError,
)
from transfer.handshake import HandshakeOffer, Peer, PeerBook
from transfer.plan import (
    IndexPlan,
    PageRuns,
    RegionSelection,
    TransferPlan,
    build_plan,
    descriptor_plan,
    finished_pages,
    index_plan,
)
from transfer.push import Pusher, PushResult, PushStats, PushStatus
from transfer.receiver import Receiver, ReceiveResult, ReceiveStatus
from transfer.regions import CacheRegion, CacheRegionLike, RegionEntry, RegionTable, region_table

__all__ = [
    "CacheRegion",
    "CacheRegionLike",
    "CompatInfo",
    "CompatibilityError",
    "FieldDiff",
    "HandshakeOffer",
    "IndexPlan",
    "PageRuns",
    "Peer",
    "PeerBook",
    "PlanError",
    "PushResult",
    "PushStats",
    "PushStatus",
    "Pusher",
    "ReceiveResult",
    "ReceiveStatus",
    "Receiver",
    "RegionEntry",
    "RegionError",
    "RegionSelection",
    "RequestCancelledError",
    "RegionTable",
    "StaleEpochError",
    "TransferAgent",
    "TransferError",
    "TransferPlan",
    "UnknownPeerError",
    "build_plan",
    "descriptor_plan",
    "finished_pages",
    "index_plan",
    "region_table",
]
