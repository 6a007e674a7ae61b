"""One NIXL agent per worker (per GPU rank): registration, peers, WRITEs, notifications.

This is the only module that calls NIXL. It registers every cache region
once at construction (one registration per region, never per request),
names itself ``"{worker_id}@{epoch}"`` so a restarted worker is a different
agent to its peers, and exposes the few operations the push and receive
sides need. Not thread-safe: drive it from the worker's step loop.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional

from transfer import messages
from transfer.compat import CompatInfo
from transfer.plan import TransferPlan
from transfer.regions import CacheRegionLike, RegionTable, region_table

log = logging.getLogger(__name__)

_epoch_counter = itertools.count()


def new_epoch() -> int:
    """A fresh epoch: nanoseconds since the Unix epoch, strictly increasing within a process.

    Peers keep the newest epoch of a worker and refuse older ones, so a restart
    (a later wall-clock time) always supersedes the dead incarnation.
    """
    return time.time_ns() + next(_epoch_counter)


def agent_name(worker_id: str, epoch: int) -> str:
    return f"{worker_id}@{epoch}"


@dataclass
class Xfer:
    """A posted WRITE. ``state``: "PROC" until NIXL reports "DONE" or "ERR"."""

    handle: object
    peer: str
    nbytes: int
    state: str = "PROC"


class TransferAgent:
    """NIXL agent of one worker with its cache regions registered.

    ``regions``: `CacheRegionLike` objects (all on one device). They are
    registered with NIXL here and stay registered until `close`; the
    tensors are kept referenced so their memory outlives the registration.
    ``progress_thread``: NIXL's background progress thread (its default;
    keep it). It costs about half a core spinning, but without it a WRITE
    over a transport that needs the target's CPU (TCP, shared memory) only
    advances while *both* processes are inside `state` / `take`: a busy or
    blocked peer stalls the transfer (seen in the two-process DRAM tests).
    """

    def __init__(
        self,
        worker_id: str,
        regions: Iterable[CacheRegionLike],
        compat: CompatInfo,
        *,
        backends: tuple[str, ...] = ("UCX",),
        epoch: Optional[int] = None,
        progress_thread: bool = True,
    ):
        from nixl._api import nixl_agent, nixl_agent_config  # deferred: importing nixl loads UCX

        if "@" in worker_id:
            raise ValueError(f"worker_id must not contain '@': {worker_id!r}")
        self._regions = list(regions)
        self.table: RegionTable = region_table(self._regions)
        self.compat = compat
        self.worker_id = worker_id
        self.epoch = new_epoch() if epoch is None else int(epoch)
        self.name = agent_name(worker_id, self.epoch)
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=list(backends))
        self._nixl = nixl_agent(self.name, config)
        self._mem = self.table.mem_type
        reg = [(e.base_addr, e.nbytes, e.device_id, f"{e.layer}:{e.kind}") for e in self.table]
        self._reg_descs = self._nixl.register_memory(reg, self._mem)
        self._peers: set[str] = set()
        self._inbox: deque[tuple[str, messages.Message]] = deque()
        self._closed = False
        self.foreign_notifs = 0
        """Notifications that were not ours (ignored)."""

    # -- metadata and peers -------------------------------------------------

    def metadata(self) -> bytes:
        """NIXL agent metadata (connection info + registrations) to hand to a peer."""
        return self._nixl.get_agent_metadata()

    def load_peer(self, metadata: bytes) -> str:
        """Load a peer's NIXL metadata; returns its agent name."""
        name = self._nixl.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._peers.add(name)
        return name

    def drop_peer(self, name: str) -> None:
        """Forget a peer's metadata and disconnect (best effort: the peer may be dead)."""
        self._peers.discard(name)
        try:
            self._nixl.remove_remote_agent(name)
        except Exception as e:  # noqa: BLE001 - a dead peer must not stop cleanup
            log.debug("remove_remote_agent(%s): %s", name, e)

    def connect(self, peer: str) -> None:
        """Establish the transport connection to ``peer`` now rather than on the first WRITE."""
        self._nixl.make_connection(peer)

    # -- transfers ------------------------------------------------------------

    def write(self, peer: str, plan: TransferPlan, notif: bytes) -> Xfer:
        """Post a WRITE of ``plan`` to ``peer``; ``notif`` is delivered to the peer after the data.

        Raises on a NIXL error (e.g. peer disconnected); callers turn that
        into a failed request.
        """
        if plan.num_descriptors == 0:
            raise ValueError("empty plan: send a notification instead")
        src = self._nixl.get_xfer_descs(plan.src, plan.src_mem)
        dst = self._nixl.get_xfer_descs(plan.dst, plan.dst_mem)
        handle = self._nixl.initialize_xfer("WRITE", src, dst, peer, notif)
        xfer = Xfer(handle=handle, peer=peer, nbytes=plan.nbytes)
        state = self._nixl.transfer(handle)
        if state == "ERR":
            self.release(xfer)
            raise RuntimeError(f"NIXL WRITE to {peer} failed when posted")
        xfer.state = state
        return xfer

    def state(self, xfer: Xfer) -> str:
        """Refresh and return ``xfer.state`` ("PROC", "DONE" or "ERR"; an exception reads as "ERR")."""
        if xfer.state == "PROC":
            try:
                xfer.state = self._nixl.check_xfer_state(xfer.handle)
            except Exception as e:  # noqa: BLE001
                log.warning("check_xfer_state to %s: %s", xfer.peer, e)
                xfer.state = "ERR"
        return xfer.state

    def release(self, xfer: Xfer) -> bool:
        """Release the handle (NIXL cancels it if still in flight). False if NIXL refused."""
        try:
            xfer.handle.release()
            return True
        except Exception as e:  # noqa: BLE001
            log.warning("release of transfer to %s failed: %s", xfer.peer, e)
            return False

    # -- notifications ----------------------------------------------------------

    def notify(self, peer: str, msg: messages.Message) -> None:
        """Send a standalone notification (not tied to a WRITE). Raises if the peer is unreachable."""
        self._nixl.send_notif(peer, messages.encode(msg))

    def _drain(self) -> None:
        for sender, raws in self._nixl.get_new_notifs().items():
            sender = sender.decode() if isinstance(sender, bytes) else sender
            for raw in raws:
                msg = messages.decode(raw)
                if msg is None:
                    self.foreign_notifs += 1
                else:
                    self._inbox.append((sender, msg))

    def take(self, *types: type) -> list[tuple[str, messages.Message]]:
        """New notifications of the given message types as ``(sender agent, message)``.

        Messages of other types stay queued for their consumer, so a push side
        and a receive side may share one agent.
        """
        self._drain()
        taken, kept = [], deque()
        for item in self._inbox:
            (taken if isinstance(item[1], types) else kept).append(item)
        self._inbox = kept
        return taken

    # -- lifetime -----------------------------------------------------------

    def close(self) -> None:
        """Disconnect from every peer and deregister the regions. The agent must not be used afterwards."""
        if not self._closed:
            self._closed = True
            for name in list(self._peers):
                self.drop_peer(name)
            try:
                self._nixl.deregister_memory(self._reg_descs)
            except Exception as e:  # noqa: BLE001
                log.warning("deregister_memory: %s", e)

    def __enter__(self) -> "TransferAgent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
