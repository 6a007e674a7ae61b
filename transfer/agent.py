"""One NIXL agent per worker (per GPU rank): registration, peers, WRITEs, notifications.

This is the only module that calls NIXL. It registers every cache region
once at construction (one registration per region, never per request),
names itself ``"{worker_id}@{epoch}"`` so a restarted worker is a different
agent to its peers, and exposes the few operations the push and receive
sides need. Not thread-safe: drive it from the worker's step loop.

A WRITE is an explicit descriptor list (`TransferPlan`, through
``initialize_xfer``) or indices into descriptor lists prepared once, never
per request: the local list over every page of every region at
construction, a peer's list at handshake (`prepare_peer`, dropped with the
peer). Each is one compressed (strided) row per region, so preparing costs
the same for 10 or 100,000 pages; a WRITE of an `IndexPlan` is then
``make_prepped_xfer`` with two int32 index arrays (NIXL merges consecutive
runs itself). `prepare` creates a WRITE without posting it (a request's
pages are known before prefill computes them) and `post` posts it.

Where the time of a WRITE goes is kept per `Xfer`: ``make_s`` (building the
request: NIXL handle creation, plus descriptor conversion on the unprepared
path) and ``post_s`` (``transfer``: the backend issues one operation per
descriptor; over UCX ``cuda_ipc`` each is a CUDA copy launch unless UCX's
scatter-gather offload, ``ucx_sgl``, batches them).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional, Union

from transfer import messages
from transfer.compat import CompatInfo
from transfer.errors import UnknownPeerError
from transfer.nixl_agent_config import DEFAULT_PROGRESS_DELAY_US, make_nixl_agent
from transfer.plan import IndexPlan, TransferPlan
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


SGL_ENV = "NIXL_UCX_SGL_ENABLE"
"""NIXL's switch for UCX scatter-gather offload of a WRITE (read when the UCX backend is created)."""

LOCAL = "NIXL_INIT_AGENT"
"""NIXL's agent name for the initiator side of a prepared descriptor list."""


@dataclass
class Xfer:
    """A WRITE. ``state``: "NEW" (`TransferAgent.prepare`d, not posted), then "PROC" until NIXL
    reports "DONE" or "ERR".

    ``descriptors``: descriptors handed to NIXL (after merging); ``make_s`` /
    ``post_s``: seconds spent creating the request and inside ``transfer``.
    """

    handle: object
    peer: str
    nbytes: int
    state: str = "PROC"
    descriptors: int = 0
    make_s: float = 0.0
    post_s: float = 0.0


@dataclass
class _Prepared:
    """A prepared descriptor list over the flat page index of ``table``."""

    handle: object
    table: RegionTable
    strided: bool


Plan = Union[IndexPlan, TransferPlan]


class TransferAgent:
    """NIXL agent of one worker with its cache regions registered.

    ``regions``: `CacheRegionLike` objects (all on one device). They are
    registered with NIXL here and stay registered until `close`; the
    tensors are kept referenced so their memory outlives the registration.
    ``progress_thread``: NIXL's background progress thread (its default;
    keep it, except on a GPU agent that pushes: `workers.push_tuning`): without
    it a WRITE
    over a transport that needs the target's CPU (TCP, shared memory) only
    advances while *both* processes are inside `state` / `take`: a busy or
    blocked peer stalls the transfer (seen in the two-process DRAM tests).
    ``progress_delay_us``: the progress thread's sleep between polling rounds
    (`transfer.nixl_agent_config`; 0 is NIXL's busy poll, half a core).
    ``ucx_sgl``: True / False sets NIXL's UCX scatter-gather offload
    (``NIXL_UCX_SGL_ENABLE``) for this agent: a WRITE is posted as one UCX
    scatter-gather operation (``cuda_ipc``: one batched CUDA copy) instead
    of one operation per descriptor. None leaves NIXL's setting (environment;
    off by default). ``backend_params``: init parameters of every backend,
    strings (NIXL's UCX plugin: ``num_threads``, a pool of posting threads
    that splits each WRITE of >= ``split_batch_size`` descriptors over
    them; ``num_workers``; ``engine_config``, ...); None: NIXL's defaults.
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
        progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
        ucx_sgl: Optional[bool] = None,
        backend_params: Optional[dict[str, str]] = None,
    ):
        from nixl._api import nixl_agent_config  # deferred: importing nixl loads UCX

        if "@" in worker_id:
            raise ValueError(f"worker_id must not contain '@': {worker_id!r}")
        self._regions = list(regions)
        self.table: RegionTable = region_table(self._regions)
        self.compat = compat
        self.worker_id = worker_id
        self.epoch = new_epoch() if epoch is None else int(epoch)
        self.name = agent_name(worker_id, self.epoch)
        params = {str(k): str(v) for k, v in (backend_params or {}).items()}
        # The backends are created here, not by nixl_agent (whose config passes num_threads only).
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=[])
        self._nixl = _new_nixl_agent(self.name, config, progress_delay_us, ucx_sgl, backends, params)
        self.ucx_sgl = ucx_sgl
        self._mem = self.table.mem_type
        reg = [(e.base_addr, e.nbytes, e.device_id, f"{e.layer}:{e.kind}") for e in self.table]
        self._reg_descs = self._nixl.register_memory(reg, self._mem)
        self._peers: set[str] = set()
        self._prepared: dict[str, _Prepared] = {}  # peer agent name -> its prepared list
        self._inbox: deque[tuple[str, messages.Message]] = deque()
        self._closed = False
        self.foreign_notifs = 0
        """Notifications that were not ours (ignored)."""
        self.warm_ups = 0
        """`messages.WarmUp` notifications received (dropped: nothing consumes them)."""
        try:
            self._local = self._prep(LOCAL, self.table)
        except Exception:
            self._nixl.deregister_memory(self._reg_descs)
            raise

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

    def prepare_peer(self, name: str, regions: RegionTable) -> None:
        """Prepare ``name``'s descriptor list over every page of ``regions`` (its handshake table).

        Once per peer (idempotent for the same table; a different table
        replaces the list). The peer's metadata must be loaded. Dropped by
        `drop_peer`.
        """
        if name not in self._peers:
            raise UnknownPeerError(f"no metadata loaded for agent {name!r}")
        known = self._prepared.get(name)
        if known is not None:
            if known.table == regions:
                return
            self._release_prepared(name)
        self._prepared[name] = self._prep(name, regions)

    def is_prepared(self, name: str) -> bool:
        return name in self._prepared

    def drop_peer(self, name: str) -> None:
        """Forget a peer's metadata and prepared list, and disconnect (best effort: the peer may be dead)."""
        self._peers.discard(name)
        self._release_prepared(name)
        try:
            self._nixl.remove_remote_agent(name)
        except Exception as e:  # noqa: BLE001 - a dead peer must not stop cleanup
            log.debug("remove_remote_agent(%s): %s", name, e)

    def connect(self, peer: str) -> None:
        """Establish the transport connection to ``peer`` now rather than on the first WRITE."""
        self._nixl.make_connection(peer)

    # -- transfers ------------------------------------------------------------

    def write(self, peer: str, plan: Plan, notif: bytes) -> Xfer:
        """Post a WRITE of ``plan`` to ``peer``; ``notif`` is delivered to the peer after the data.

        `prepare` then `post`. Raises as they do; callers turn that into a
        failed request.
        """
        xfer = self.prepare(peer, plan)
        try:
            self.post(xfer, notif)
        except Exception:
            self.release(xfer)
            raise
        return xfer

    def prepare(self, peer: str, plan: Plan) -> Xfer:
        """Create the NIXL request of a WRITE of ``plan`` to ``peer`` without posting it (state "NEW").

        An `IndexPlan` goes through the prepared lists (the peer must have
        been prepared with the table the plan was computed from); a
        `TransferPlan` through ``initialize_xfer``. Creating a request moves
        no byte: a caller that knows its pages early prepares then and
        `post`s when the bytes are final. Release it (`release`) if never
        posted. Raises on a NIXL error or an unprepared peer.
        """
        if plan.num_descriptors == 0:
            raise ValueError("empty plan: send a notification instead")
        t0 = time.perf_counter()
        if isinstance(plan, IndexPlan):
            remote = self._prepared.get(peer)
            if remote is None:
                raise UnknownPeerError(f"no prepared descriptor list for {peer!r}: handshake (PeerBook.accept) first")
            if remote.table is not plan.remote and remote.table != plan.remote:
                raise ValueError(f"plan was computed for another region table of {peer!r} than the prepared one")
            handle = self._nixl.make_prepped_xfer(
                "WRITE", self._local.handle, plan.local_idx, remote.handle, plan.remote_idx, b"",
                skip_desc_merge=not plan.merged,
            )
        else:
            src = self._nixl.get_xfer_descs(plan.src, plan.src_mem)
            dst = self._nixl.get_xfer_descs(plan.dst, plan.dst_mem)
            handle = self._nixl.initialize_xfer("WRITE", src, dst, peer, b"")
        return Xfer(handle=handle, peer=peer, nbytes=plan.nbytes, state="NEW", descriptors=plan.num_descriptors,
                    make_s=time.perf_counter() - t0)

    def post(self, xfer: Xfer, notif: bytes = b"") -> None:
        """Post a `prepare`d WRITE, or post a completed one again unchanged (benchmarks: the
        transport's time without planning or request creation); ``notif`` as in `write`.

        Raises if it is in flight or failed, or if NIXL refuses it.
        """
        if xfer.state != "NEW" and self.state(xfer) != "DONE":
            raise ValueError(f"only a new or completed WRITE can be posted (state {xfer.state})")
        t0 = time.perf_counter()
        state = self._nixl.transfer(xfer.handle, notif)
        xfer.post_s = time.perf_counter() - t0
        if state == "ERR":
            xfer.state = "ERR"
            raise RuntimeError(f"NIXL WRITE to {xfer.peer} failed when posted")
        xfer.state = state

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
                elif isinstance(msg, messages.WarmUp):
                    self.warm_ups += 1
                else:
                    self._inbox.append((sender, msg))

    def has(self, *types: type) -> bool:
        """Whether a notification of the given message types is waiting (it stays queued for `take`)."""
        self._drain()
        return any(isinstance(m, types) for _, m in self._inbox)

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

    # -- prepared descriptor lists ------------------------------------------------

    def _prep(self, name: str, table: RegionTable) -> _Prepared:
        """Prepare the flat page index of ``table`` (``name``: `LOCAL` or a peer agent)."""
        try:
            # Compressed: one (address, len, device, stride, count) row per region.
            handle = self._nixl.prep_xfer_dlist(name, table.strided_rows(), table.mem_type)
            return _Prepared(handle, table, strided=True)
        except Exception as e:  # noqa: BLE001 - a NIXL without Nx5 lists: spell every page out
            log.debug("strided prep_xfer_dlist(%s) failed (%s); preparing one descriptor per page", name, e)
        handle = self._nixl.prep_xfer_dlist(name, table.page_rows(), table.mem_type)
        return _Prepared(handle, table, strided=False)

    def _release_prepared(self, name: str) -> None:
        prepared = self._prepared.pop(name, None)
        if prepared is not None:
            try:
                prepared.handle.release()
            except Exception as e:  # noqa: BLE001
                log.warning("release of the prepared list of %s: %s", name, e)

    # -- lifetime -----------------------------------------------------------

    def close(self) -> None:
        """Disconnect from every peer and deregister the regions. The agent must not be used afterwards."""
        if not self._closed:
            self._closed = True
            for name in set(self._peers) | set(self._prepared):
                self.drop_peer(name)
            try:
                self._local.handle.release()
            except Exception as e:  # noqa: BLE001
                log.warning("release of the local prepared list: %s", e)
            try:
                self._nixl.deregister_memory(self._reg_descs)
            except Exception as e:  # noqa: BLE001
                log.warning("deregister_memory: %s", e)

    def __enter__(self) -> "TransferAgent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _new_nixl_agent(name: str, config, progress_delay_us: int, ucx_sgl: Optional[bool], backends,
                    params: dict[str, str]):
    """Create the NIXL agent and its ``backends`` (init ``params``), with
    ``NIXL_UCX_SGL_ENABLE`` set as asked while the UCX backend is made.

    NIXL reads the switch from the environment when the backend is created;
    the previous value is restored afterwards so other agents are unaffected.
    """

    def make():
        agent = make_nixl_agent(name, config, progress_delay_us)
        for b in backends:
            agent.create_backend(b, dict(params))
        return agent

    if ucx_sgl is None:
        return make()
    old = os.environ.get(SGL_ENV)
    os.environ[SGL_ENV] = "1" if ucx_sgl else "0"
    try:
        return make()
    finally:
        if old is None:
            os.environ.pop(SGL_ENV, None)
        else:
            os.environ[SGL_ENV] = old
