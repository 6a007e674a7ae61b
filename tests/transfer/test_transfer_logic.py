"""Pusher / Receiver state machines against a scripted fake agent (no NIXL, injected clock)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from transfer import (
    CompatInfo,
    IndexPlan,
    PlanError,
    Pusher,
    PushStatus,
    Receiver,
    ReceiveStatus,
    RequestCancelledError,
    TransferPlan,
    UnknownPeerError,
)
from transfer.agent import Xfer
from transfer.handshake import Peer
from transfer.messages import ChunkDone, PushAborted, PushCancelled, PushSettled, WarmUp, decode
from transfer.regions import RegionEntry, RegionTable

COMPAT = CompatInfo("m", 2, 64, "fp8_656", "fp8_132", True)


def table(base: int, num_pages: int = 32) -> RegionTable:
    return RegionTable(tuple(
        RegionEntry(layer, kind, base + i * 10**6, bpp, num_pages, "DRAM", 0)
        for i, (layer, kind, bpp) in enumerate([(0, "mla", 100), (0, "index", 40), (1, "mla", 100), (1, "index", 40)])
    ))


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@dataclass
class FakeAgent:
    """Records WRITEs and notifications; the test sets each WRITE's state and injects inbound messages."""

    name: str
    table: RegionTable = field(default_factory=lambda: table(1 << 20))
    writes: list = field(default_factory=list)
    prepared: list = field(default_factory=list)
    unposted: list = field(default_factory=list)
    sent: list = field(default_factory=list)
    inbox: list = field(default_factory=list)
    fail_write: bool = False
    fail_notify: bool = False
    done_on_write: bool = False
    released: int = 0

    def prepare(self, peer, plan):
        if self.fail_write:
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
        x = Xfer(handle=plan, peer=peer, nbytes=plan.nbytes, state="NEW", descriptors=plan.num_descriptors)
        self.prepared.append(x)
        return x

    def post(self, x, notif=b""):
        if self.fail_write:
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
        assert x.state == "NEW"
        x.state = "DONE" if self.done_on_write else "PROC"
        self.writes.append((x, x.handle, decode(notif)))

    def state(self, x):
        return x.state

    def release(self, x):
        # Handles prepared at begin and never posted are counted apart (`unposted`).
        if x.state == "NEW":
            self.unposted.append(x)
        else:
            self.released += 1
        return True

    def notify(self, peer, msg):
        if self.fail_notify:
            raise RuntimeError("unreachable")
        self.sent.append((peer, msg))

    def has(self, *types):
        return any(isinstance(m[1], types) for m in self.inbox)

    def take(self, *types):
        got = [m for m in self.inbox if isinstance(m[1], types)]
        self.inbox = [m for m in self.inbox if not isinstance(m[1], types)]
        return got

    def connect(self, peer):
        pass


class FakeBook:
    def __init__(self, *peers):
        self._p = {p.agent_name: p for p in peers}

    def get(self, name):
        if name not in self._p:
            raise UnknownPeerError(name)
        return self._p[name]

    def knows(self, name):
        return name in self._p

    def forget(self, name):
        self._p.pop(name, None)


DEC = Peer("dec", 1, "dec@1", table(1 << 30, 48), COMPAT)
DEC2 = Peer("dec2", 1, "dec2@1", table(1 << 31, 48), COMPAT)
PRE = Peer("pre", 1, "pre@1", table(1 << 20), COMPAT)
PRE2 = Peer("pre", 2, "pre@2", table(1 << 20), COMPAT)


def make_pusher(path="auto", **kw):
    agent, clock = FakeAgent("pre@1", **kw), Clock()
    return Pusher(agent, FakeBook(DEC, DEC2), clock=clock, path=path), agent, clock


# -- pusher ----------------------------------------------------------------------


def test_push_chunks_follow_finished_pages_and_complete():
    pusher, agent, clock = make_pusher()
    pusher.begin("r", "dec@1", 300, [0, 1, 2, 3, 4], [9, 10, 11, 20, 21], 10.0)
    assert pusher.push("r", 50)  # no full page yet: nothing sent
    assert agent.writes == []
    clock.t = 1.0
    pusher.push("r", 130)  # pages 0-1
    clock.t = 2.5
    pusher.push("r", 300)  # pages 2-4 incl. partial last page
    clock.t = 2.75
    assert [w[1].num_pages for w in agent.writes] == [2, 3]
    assert [w[2] for w in agent.writes] == [ChunkDone("r", 0), ChunkDone("r", 1, 2, 5)]
    # Chunk 1: per region [2 -> 11] and [3-4 -> 20-21] -> 2 descriptors x 4 regions.
    assert agent.writes[1][1].num_descriptors == 8
    assert pusher.poll() == []  # WRITEs still in flight
    for x, _, _ in agent.writes:
        x.state = "DONE"
    (res,) = pusher.poll()
    assert (res.request_id, res.status, res.pages, res.chunks) == ("r", PushStatus.DONE, (0, 1, 2, 3, 4), 2)
    assert res.nbytes == 5 * 280 and agent.sent == [] and not pusher.active
    # From begin (t=0) to the end, and from the last chunk's post (t=2.5) to the end.
    assert (res.seconds, res.tail_seconds) == (2.75, 0.25)
    assert not pusher.push("r", 300)  # finished request: ignored


def test_final_chunk_without_new_pages_is_a_standalone_notification():
    pusher, agent, _ = make_pusher()
    pusher.begin("r", "dec@1", 128, [0, 1], [0, 1], 10.0)
    pusher.push("r", 127)  # page 0 final
    pusher.push("r", 128)  # page 1 final, last chunk
    assert [w[1].num_pages for w in agent.writes] == [1, 1]
    # An empty prompt has no page to write, but its count must still reach decode.
    pusher.begin("e", "dec@1", 0, [], [], 10.0)
    pusher.push("e", 0)
    assert len(agent.writes) == 2
    assert agent.sent == [("dec@1", ChunkDone("e", 0, 1, 0))]
    (res,) = pusher.poll()
    assert res.request_id == "e" and res.status is PushStatus.DONE


def test_push_rejects_bad_requests():
    pusher, agent, _ = make_pusher()
    with pytest.raises(UnknownPeerError):
        pusher.begin("r", "dec@0", 64, [0], [0], 1.0)
    with pytest.raises(PlanError, match="needs 2 pages"):
        pusher.begin("r", "dec@1", 65, [0], [0], 1.0)
    with pytest.raises(PlanError, match="out of range"):
        pusher.begin("r", "dec@1", 64, [0], [48], 1.0)
    assert not pusher.active
    pusher.begin("r", "dec@1", 200, [0, 1, 2, 3], [0, 1, 2, 3], 1.0)
    with pytest.raises(ValueError, match="already"):
        pusher.begin("r", "dec@1", 64, [0], [0], 1.0)
    pusher.push("r", 130)
    with pytest.raises(ValueError, match="backwards"):
        pusher.push("r", 64)


def test_write_error_fails_only_that_request_and_tells_decode():
    pusher, agent, _ = make_pusher()
    pusher.begin("a", "dec@1", 64, [0], [0], 10.0)
    pusher.begin("b", "dec@1", 64, [1], [1], 10.0)
    pusher.push("a", 64)
    pusher.push("b", 64)
    agent.writes[0][0].state = "ERR"
    agent.writes[1][0].state = "DONE"
    res = {r.request_id: r for r in pusher.poll()}
    assert res["a"].status is PushStatus.FAILED and res["b"].status is PushStatus.DONE
    assert agent.sent == [("dec@1", PushAborted("a", "WRITE failed"))]


def test_post_error_fails_request_even_if_abort_cannot_be_sent():
    pusher, agent, _ = make_pusher(fail_write=True, fail_notify=True)
    pusher.begin("a", "dec@1", 64, [0], [0], 10.0)
    assert not pusher.push("a", 64)
    (res,) = pusher.poll()
    assert res.status is PushStatus.FAILED and "NIXL_ERR_REMOTE_DISCONNECT" in res.reason and res.pages == (0,)


def test_push_deadline_and_cancel_and_abort_and_peer_lost():
    pusher, agent, clock = make_pusher()
    for rid in "abcd":
        pusher.begin(rid, "dec@1", 200, [4 * "abcd".index(rid) + i for i in range(4)], list(range(4)), 1.0 if rid == "a" else 5.0)
    pusher.push("a", 64)
    agent.inbox.append(("dec@1", PushCancelled("b", "client gone")))
    agent.inbox.append(("dec@0", PushCancelled("c", "stale epoch")))  # an agent not in the book: ignored
    clock.t = 1.5
    res = {r.request_id: r for r in pusher.poll()}
    assert res["a"].status is PushStatus.EXPIRED and res["b"].status is PushStatus.CANCELLED and set(res) == {"a", "b"}
    # b had nothing in flight: its cancel is answered at once. a's WRITE is
    # still in flight: decode hears of a only once it ended.
    assert agent.sent == [("dec@1", PushSettled("b", "decode: client gone"))]
    assert pusher.draining == ["a"] and agent.released == 0 and pusher.writes_in_flight() == 1
    assert pusher.has_work()
    agent.writes[0][0].state = "DONE"
    assert pusher.poll() == []
    assert agent.sent[1:] == [("dec@1", PushAborted("a", res["a"].reason))] and agent.released == 1
    assert pusher.abort("c", "prefill OOM").status is PushStatus.FAILED
    assert agent.sent[2:] == [("dec@1", PushAborted("c", "prefill OOM"))]  # nothing in flight: told at once
    assert pusher.abort("c", "again") is None
    (lost,) = pusher.peer_lost("dec@1")
    assert lost.request_id == "d" and lost.status is PushStatus.FAILED and not pusher.active
    assert len(agent.sent) == 3 and not pusher.has_work()


def test_cancel_of_a_request_not_pushing_is_settled_and_refused_later():
    pusher, agent, _ = make_pusher()
    pusher.begin("done", "dec@1", 64, [0], [0], 10.0)
    pusher.push("done", 64)
    agent.writes[0][0].state = "DONE"
    assert [r.status for r in pusher.poll()] == [PushStatus.DONE]
    agent.inbox += [("dec@1", PushCancelled("done", "late")), ("dec@1", PushCancelled("early", "deadline"))]
    assert pusher.has_work()
    assert pusher.poll() == []
    assert agent.sent == [("dec@1", PushSettled("done", "no write in flight")),
                          ("dec@1", PushSettled("early", "no write in flight"))]
    # A task arriving after its cancel was answered must not push (decode re-used the pages) ...
    with pytest.raises(RequestCancelledError):
        pusher.begin("early", "dec@1", 64, [1], [1], 10.0)
    # ... even when the cancel is still unread when it begins.
    agent.inbox.append(("dec@1", PushCancelled("later", "client gone")))
    with pytest.raises(RequestCancelledError):
        pusher.begin("later", "dec@1", 64, [1], [1], 10.0)
    # Cancelled for one decode agent only: the same id to another is not affected.
    pusher.begin("early", "dec2@1", 64, [1], [1], 10.0)
    assert pusher.active == ["early"]


def test_cancel_of_a_draining_request_waits_for_the_drain():
    pusher, agent, clock = make_pusher()
    pusher.begin("a", "dec@1", 200, [0, 1, 2, 3], [0, 1, 2, 3], 10.0)
    pusher.push("a", 64)
    assert pusher.abort("a", "prefill OOM").status is PushStatus.FAILED
    agent.inbox.append(("dec@1", PushCancelled("a", "deadline")))
    assert pusher.poll() == [] and agent.sent == []  # its WRITE is still in flight: no answer yet
    agent.writes[0][0].state = "ERR"  # ended (failed): nothing more can land
    pusher.poll()
    assert agent.sent == [("dec@1", PushAborted("a", "prefill OOM"))] and not pusher.has_work()


def test_drain_to_a_forgotten_peer_is_dropped():
    pusher, agent, _ = make_pusher()
    pusher.begin("a", "dec@1", 200, [0, 1, 2, 3], [0, 1, 2, 3], 10.0)
    pusher.push("a", 64)
    pusher.abort("a", "shutdown")
    pusher.peers.forget("dec@1")
    pusher.poll()
    assert pusher.draining == [] and agent.sent == []


def test_push_fails_requests_of_a_forgotten_or_restarted_peer():
    pusher, agent, _ = make_pusher()
    pusher.begin("a", "dec@1", 64, [0], [0], 10.0)
    pusher.begin("b", "dec2@1", 64, [1], [1], 10.0)
    pusher.push("a", 64)
    pusher.peers.forget("dec@1")  # e.g. a newer epoch of "dec" was accepted
    (res,) = pusher.poll()
    assert (res.request_id, res.status) == ("a", PushStatus.FAILED) and "restarted" in res.reason
    assert pusher.active == ["b"] and agent.sent == []


def locate(tab, i):
    """(region key, page) of flat page index ``i`` of ``tab``."""
    key = max((k for k in tab.keys() if tab.first_index(*k) <= i), key=lambda k: tab.first_index(*k))
    return key, i - tab.first_index(*key)


def written_pages(plan, local, remote):
    """Sorted distinct (region key, local page, remote page) an `IndexPlan` copies (same region on both sides)."""
    out = set()
    for li, ri in zip(plan.local_idx.tolist(), plan.remote_idx.tolist()):
        (lk, lpg), (rk, rpg) = locate(local, li), locate(remote, ri)
        assert lk == rk
        out.add((lk, lpg, rpg))
    return sorted(out)


def test_prepared_path_posts_index_plans_of_the_chunk_pages_and_counts_stats():
    pusher, agent, _ = make_pusher(path="prepared")
    pusher.begin("r", "dec@1", 300, [0, 1, 2, 3, 4], [9, 10, 11, 20, 21], 10.0)
    pusher.push("r", 130)
    pusher.push("r", 300)
    plans = [w[1] for w in agent.writes]
    assert all(isinstance(p, IndexPlan) for p in plans)
    keys = agent.table.keys()
    assert written_pages(plans[1], agent.table, DEC.regions) == sorted((k, l, r) for k in keys for l, r in ((2, 11), (3, 20), (4, 21)))
    st = pusher.stats
    assert (st.writes, st.descriptors, st.nbytes) == (2, 4 * 1 + 4 * 2, 5 * 280)
    assert st.plan_s >= 0 and st.make_s == 0 and st.post_s == 0  # the fake agent reports no NIXL time


def explicit_pairs(plan):
    """(src address, dst address, length) of every descriptor of a `TransferPlan`."""
    return sorted(zip(plan.src[:, 0].tolist(), plan.dst[:, 0].tolist(), plan.src[:, 1].tolist()))


@pytest.mark.parametrize("path", ["explicit", "auto"])
def test_explicit_path_posts_one_descriptor_per_region_and_page_run(path):
    agent, clock = FakeAgent("pre@1"), Clock()
    pusher = Pusher(agent, FakeBook(DEC), path=path, clock=clock)
    pusher.begin("r", "dec@1", 300, [0, 1, 2, 3, 4], [9, 10, 11, 20, 21], 10.0)
    pusher.push("r", 300)
    (plan,) = [w[1] for w in agent.writes]
    # Per region [0-2 -> 9-11] and [3-4 -> 20-21].
    assert isinstance(plan, TransferPlan) and plan.num_descriptors == 4 * 2 and plan.num_pages == 5
    assert plan.nbytes == 5 * 280 and (plan.src[:, 1] == plan.dst[:, 1]).all()
    loc, rem = agent.table, DEC.regions
    assert explicit_pairs(plan) == sorted(
        (loc.get(*k).page_addr(a), rem.get(*k).page_addr(b), n * loc.get(*k).bytes_per_page)
        for k in loc.keys() for a, b, n in ((0, 9, 3), (3, 20, 2)))


def test_run_pages_cuts_explicit_descriptors_but_not_prepared_lists():
    agent, clock = FakeAgent("pre@1"), Clock()
    cut = Pusher(agent, FakeBook(DEC), path="explicit", clock=clock, run_pages=2)
    cut.begin("r", "dec@1", 300, [0, 1, 2, 3, 4], [9, 10, 11, 20, 21], 10.0)
    cut.push("r", 300)
    (plan,) = [w[1] for w in agent.writes]
    # Runs [0-2 -> 9-11] and [3-4 -> 20-21] cut to at most 2 pages: 3 descriptors per region, same bytes.
    assert plan.num_descriptors == 4 * 3 and plan.nbytes == 5 * 280
    loc, rem = agent.table, DEC.regions
    assert explicit_pairs(plan) == sorted(
        (loc.get(*k).page_addr(a), rem.get(*k).page_addr(b), n * loc.get(*k).bytes_per_page)
        for k in loc.keys() for a, b, n in ((0, 9, 2), (2, 11, 1), (3, 20, 2)))
    agent2 = FakeAgent("pre@1")
    prep = Pusher(agent2, FakeBook(DEC), path="prepared", clock=clock, run_pages=2)
    prep.begin("q", "dec@1", 300, [0, 1, 2, 3, 4], [9, 10, 11, 20, 21], 10.0)
    prep.push("q", 300)
    assert agent2.writes[0][1].num_descriptors == 4 * 2  # NIXL merges prepared indices itself
    with pytest.raises(ValueError, match="run_pages"):
        Pusher(agent, FakeBook(DEC), run_pages=0)


def test_auto_path_switches_to_prepared_lists_above_the_descriptor_limit(monkeypatch):
    import transfer.push as push_mod

    monkeypatch.setattr(push_mod, "EXPLICIT_MAX_DESCRIPTORS", 4 * 2)
    pusher, agent, _ = make_pusher()
    pusher.begin("r", "dec@1", 6 * 64, [0, 1, 2, 3, 4, 5], [9, 10, 11, 20, 21, 30], 10.0)
    pusher.push("r", 5 * 64)  # pages 0-4: two runs per region, 8 descriptors
    pusher.push("r", 6 * 64)  # page 5 alone: 4 descriptors
    pusher.begin("q", "dec@1", 3 * 64, [6, 8, 10], [1, 3, 5], 10.0)
    pusher.push("q", 3 * 64)  # three runs per region: 12 > 8
    kinds = [type(w[1]) for w in agent.writes]
    assert kinds == [TransferPlan, TransferPlan, IndexPlan]
    assert agent.writes[2][1].num_descriptors == 4 * 3
    with pytest.raises(ValueError, match="path"):
        Pusher(agent, FakeBook(DEC), path="fast")


@pytest.mark.parametrize("path", ["prepared", "explicit"])
def test_warm_up_writes_one_page_per_region_repeatedly_and_once(path):
    agent, clock = FakeAgent("pre@1", done_on_write=True), Clock()
    pusher = Pusher(agent, FakeBook(DEC), path=path, clock=clock)
    pusher.warm_up("dec@1", local_page=3, remote_page=47, repeat=5)
    # Three rounds by default, one WRITE after the other: the same page of every region 5 times
    # (the posting threads' workers), then once (a WRITE small enough for the calling thread's).
    assert len(agent.writes) == 6 and len({id(w[1]) for w in agent.writes}) == 6
    x, plan, notif = agent.writes[0]
    # The notification is a WarmUp (the receiving agent drops it); notify=False sends none.
    assert all(isinstance(w[2], WarmUp) for w in agent.writes)
    assert [(w[1].num_descriptors, w[1].num_pages, w[1].nbytes) for w in agent.writes] == [
        (4 * 5, 5, 5 * 280), (4, 1, 280)] * 3
    pusher.warm_up("dec@1", local_page=3, remote_page=47, repeat=2, notify=False, rounds=1)
    assert len(agent.writes) == 8 and agent.writes[6][2] is None and agent.writes[7][2] is None
    pusher.warm_up("dec@1", local_page=3, remote_page=47, repeat=1, rounds=1)
    assert len(agent.writes) == 9
    if path == "prepared":
        assert written_pages(plan, agent.table, DEC.regions) == sorted((k, 3, 47) for k in agent.table.keys())
    else:
        assert {(int(s), int(d)) for s, d in zip(plan.src[:, 0], plan.dst[:, 0])} == {
            (agent.table.get(*k).page_addr(3), DEC.regions.get(*k).page_addr(47)) for k in agent.table.keys()}
    with pytest.raises(PlanError, match="out of range"):
        pusher.warm_up("dec@1", remote_page=48)
    with pytest.raises(ValueError, match="repeat"):
        pusher.warm_up("dec@1", repeat=0)
    with pytest.raises(ValueError, match="rounds"):
        pusher.warm_up("dec@1", rounds=0)


def test_peer_selection_is_computed_once_and_dropped_with_the_peer():
    pusher, agent, _ = make_pusher()
    pusher.begin("a", "dec@1", 64, [0], [0], 10.0)
    sel = pusher._selections["dec@1"]
    pusher.begin("b", "dec@1", 64, [1], [1], 10.0)
    assert pusher._selections["dec@1"] is sel
    pusher.peers.forget("dec@1")
    pusher.poll()
    assert "dec@1" not in pusher._selections


# -- receiver ----------------------------------------------------------------------


def make_receiver(book=None):
    agent, clock, released = FakeAgent("dec@1"), Clock(), []
    return Receiver(agent, book, release_pages=released.append, clock=clock), agent, clock, released


def test_receiver_with_peer_book_requires_handshake_and_drops_superseded_peers():
    book = FakeBook(PRE)
    recv, agent, _, released = make_receiver(book)
    with pytest.raises(UnknownPeerError):
        recv.expect("x", "pre@2", 64, [0], 1.0)
    recv.expect("r", "pre@1", 64, [0], 10.0)
    assert recv.poll() == []
    book.forget("pre@1")  # the prefill restarted as pre@2: the old process writes nothing more
    (res,) = recv.poll()
    assert res.status is ReceiveStatus.FAILED and res.pages == (0,) and agent.sent == []
    assert not res.held and released == [(0,)]
    with pytest.raises(ValueError, match="PeerBook"):
        make_receiver()[0].expect("any", None, 64, [0], 1.0)


def test_receiver_completes_on_count_in_any_order():
    recv, agent, _, released = make_receiver()
    recv.expect("r", "pre@1", 300, [7, 8, 9, 10, 11], 5.0)
    agent.inbox += [("pre@1", ChunkDone("r", 2, 3, 5)), ("pre@1", ChunkDone("r", 0))]
    assert recv.poll() == []
    agent.inbox += [("pre@1", ChunkDone("r", 0)), ("pre@1", ChunkDone("r", 1))]  # a duplicate is harmless
    (res,) = recv.poll()
    assert (res.status, res.pages, res.chunks) == (ReceiveStatus.DONE, (7, 8, 9, 10, 11), 3)
    assert released == [] and not recv.has_work  # DONE: the pages are the caller's


def test_receiver_ignores_late_unknown_and_other_epoch_notifications():
    recv, agent, clock, released = make_receiver()
    recv.expect("r", "pre@2", 64, [0], 1.0)
    agent.inbox += [("pre@1", ChunkDone("r", 0, 1, 1)),  # the dead epoch of the same prefill
                    ("pre@2", ChunkDone("zzz", 0, 1, 1))]  # never expected
    assert recv.poll() == [] and recv.ignored_notifs == 2
    clock.t = 2.0
    (res,) = recv.poll()
    assert res.status is ReceiveStatus.EXPIRED and res.chunks == 0 and res.held
    assert agent.sent == [("pre@2", PushCancelled("r", res.reason))]
    # Late notifications of the dead request are ignored (a settle from
    # another agent included); the pages stay held until pre@2 settles.
    agent.inbox += [("pre@2", ChunkDone("r", 0, 1, 1)), ("pre@1", PushSettled("r", "not mine")),
                    ("pre@2", PushSettled("zzz", "never had it"))]
    assert recv.poll() == [] and recv.ignored_notifs == 5
    assert recv.held == {"r": (0,)} and released == [] and recv.has_work
    agent.inbox.append(("pre@2", PushAborted("r", "late")))  # sent after its WRITEs ended: settles too
    assert recv.poll() == [] and recv.ignored_notifs == 5
    assert recv.held == {} and released == [(0,)] and recv.settled == 1 and not recv.has_work
    with pytest.raises(ValueError, match="fresh id"):
        recv.expect("r", "pre@2", 64, [0], 1.0)


def test_held_pages_wait_for_the_settle_and_the_cancel_is_resent():
    book = FakeBook(PRE)
    recv, agent, clock, released = make_receiver(book)
    recv.expect("r", "pre@1", 200, [4, 5, 6, 7], 1.0)
    agent.inbox.append(("pre@1", ChunkDone("r", 0)))
    clock.t = 1.5
    (res,) = recv.poll()
    assert (res.status, res.chunks, res.held) == (ReceiveStatus.EXPIRED, 1, True)
    clock.t = 2.0
    recv.poll()
    assert len(agent.sent) == 1  # re-sent only after resend_cancel_s
    clock.t = 2.6
    recv.poll()
    assert agent.sent == [("pre@1", PushCancelled("r", res.reason))] * 2
    assert released == [] and recv.held_pages == 4
    agent.inbox.append(("pre@1", PushSettled("r", "no write in flight")))
    recv.poll()
    assert released == [(4, 5, 6, 7)] and recv.held_pages == 0


def test_held_pages_come_back_when_the_writer_is_lost_or_forgotten():
    book = FakeBook(PRE, Peer("pre2", 1, "pre2@1", table(1 << 20), COMPAT))
    recv, agent, clock, released = make_receiver(book)
    recv.expect("a", "pre@1", 64, [1], 10.0)
    recv.expect("b", "pre2@1", 64, [2], 10.0)
    assert recv.cancel("a", "client gone").held and recv.cancel("b", "client gone").held
    assert recv.peer_lost("pre@1") == []  # no wait left, but "a" stops waiting for it
    assert released == [(1,)]
    book.forget("pre2@1")  # e.g. its replica left the directory
    recv.poll()
    assert released == [(1,), (2,)] and not recv.has_work


def test_receiver_failures():
    recv, agent, _, released = make_receiver()
    recv.expect("short", "pre@1", 130, [0, 1, 2], 5.0)
    recv.expect("bad_index", "pre@1", 64, [3], 5.0)
    recv.expect("aborted", "pre@1", 64, [4], 5.0)
    recv.expect("gone", "pre@1", 64, [5], 5.0)
    recv.expect("other", "pre@9", 64, [6], 5.0)
    agent.inbox += [("pre@1", ChunkDone("short", 0, 1, 2)),  # prefill counted 2 pages, decode reserved 3
                    ("pre@1", ChunkDone("bad_index", 3)), ("pre@1", ChunkDone("bad_index", 0, 1, 1)),
                    ("pre@1", PushAborted("aborted", "WRITE failed"))]
    res = {r.request_id: r for r in recv.poll()}
    assert {k: r.status for k, r in res.items()} == dict.fromkeys(["short", "bad_index", "aborted"], ReceiveStatus.FAILED)
    assert "pushed 2 pages, 3 reserved" in res["short"].reason
    assert "prefill aborted: WRITE failed" == res["aborted"].reason
    assert recv.cancel("gone", "client disconnected").status is ReceiveStatus.CANCELLED
    assert ("pre@1", PushCancelled("gone", "client disconnected")) in agent.sent
    assert recv.cancel("gone", "x") is None
    (lost,) = recv.peer_lost("pre@9")
    assert lost.request_id == "other" and lost.pages == (6,) and not recv.active
    # Ended by the peer (its abort, its loss): back at once. Ended here
    # (inconsistent notifications, cancel): held until pre@1 settles.
    assert released == [(4,), (6,)]
    assert recv.held == {"short": (0, 1, 2), "bad_index": (3,), "gone": (5,)}
    agent.inbox += [("pre@1", PushSettled(rid, "done")) for rid in ("short", "bad_index", "gone")]
    recv.poll()
    assert released == [(4,), (6,), (0, 1, 2), (3,), (5,)]
    with pytest.raises(PlanError, match="needs 2 pages"):
        recv.expect("n", "pre@1", 65, [0], 1.0)


def test_whole_request_write_is_prepared_at_begin_and_posted_or_released_never_leaked():
    pusher, agent, clock = make_pusher()
    # One chunk carries every page: the WRITE prepared at begin is the one posted.
    pusher.begin("one", "dec@1", 200, [0, 1, 2, 3], [5, 6, 7, 8], 10.0)
    (ready,) = agent.prepared
    assert ready.state == "NEW" and ready.descriptors == 4 and not agent.writes
    pusher.push("one", 200)
    ((x, plan, notif),) = agent.writes
    assert x is ready and len(agent.prepared) == 1 and plan.num_pages == 4
    assert notif == ChunkDone("one", 0, count=1, pages=4)
    # Chunked: the first partial chunk drops the prepared WRITE (released unposted) and plans its own.
    pusher.begin("two", "dec@1", 200, [10, 11, 12, 13], [15, 16, 17, 18], 10.0)
    ready2 = agent.prepared[-1]
    pusher.push("two", 128)
    assert [id(u) for u in agent.unposted] == [id(ready2)] and agent.writes[-1][0] is not ready2 and agent.writes[-1][1].num_pages == 2
    pusher.push("two", 200)
    assert agent.writes[-1][1].num_pages == 2
    # Ended before any push (abort, cancel, deadline, lost peer): released unposted.
    for rid in ("ab", "cx", "dl"):
        pusher.begin(rid, "dec@1", 64, [20 + len(agent.prepared)], [30 + len(agent.prepared)], 1.0)
    pusher.begin("lost", "dec2@1", 64, [25], [40], 10.0)
    pusher.abort("ab", "shutdown")
    agent.inbox.append(("dec@1", PushCancelled("cx", "client gone")))
    clock.t = 2.0
    pusher.poll()
    pusher.peer_lost("dec2@1")
    assert pusher.active == ["one", "two"]
    posted, unposted = {id(w[0]) for w in agent.writes}, {id(u) for u in agent.unposted}
    assert all((id(x) in posted) != (id(x) in unposted) for x in agent.prepared)  # each exactly one of the two
    assert len(agent.unposted) == 5
    # A failing prepare at begin only means the push builds its WRITE then.
    agent.fail_write = True
    pusher.begin("late", "dec@1", 64, [26], [41], 10.0)
    agent.fail_write = False
    pusher.push("late", 64)
    assert agent.writes[-1][1].num_pages == 1 and all(agent.writes[-1][0] is not u for u in agent.unposted)


def test_begin_without_prepare_builds_the_write_at_push():
    pusher, agent, _ = make_pusher()
    pusher.begin("r", "dec@1", 128, [0, 1], [2, 3], 10.0, prepare=False)
    assert agent.prepared == []
    pusher.push("r", 128)
    ((x, plan, _),) = agent.writes
    assert plan.num_pages == 2 and agent.prepared == [x] and agent.unposted == []


def test_writes_wait_for_their_fence_in_push_order_and_never_leak():
    """The fence is taken when pages are pushed; a chunk's WRITE is posted once its check passes,
    in push order, by `push` or `poll`, and a request is done only once every chunk was posted."""
    written = set()  # fence tokens the "device" has reached
    fences = []

    def fence():
        token = len(fences)
        fences.append(token)
        return lambda: token in written

    agent, clock = FakeAgent("pre@1", done_on_write=True), Clock()
    pusher = Pusher(agent, FakeBook(DEC), clock=clock, fence=fence)
    pusher.warm_up("dec@1")  # garbage of page 0: nothing computed to wait for
    assert fences == [] and len(agent.writes) == 6
    agent.writes.clear()
    agent.prepared.clear()
    pusher.begin("r", "dec@1", 129, [0, 1, 2], [3, 4, 5], 10.0)
    assert pusher.push("r", 64)    # page 0: fence 0
    assert pusher.push("r", 100)   # no new page: no fence
    assert pusher.push("r", 129)   # pages 1-2, the last chunk: fence 1
    assert fences == [0, 1] and agent.writes == []
    assert pusher.poll(spin_s=0.01) == [] and agent.writes == []  # the device has written nothing yet
    written.add(1)  # a later fence passed first: still posted in push order
    assert pusher.poll() == [] and agent.writes == []
    written.add(0)
    (res,) = pusher.poll()  # both posted (done at once here), then the request completes
    assert [w[1].num_pages for w in agent.writes] == [1, 2] and res.status is PushStatus.DONE
    # The WRITE prepared at begin waits too; an empty prompt has no page and no fence.
    pusher.begin("w", "dec@1", 64, [6], [7], 10.0)
    ready_w = agent.prepared[-1]
    pusher.push("w", 64)
    pusher.begin("e", "dec@1", 0, [], [], 10.0)
    pusher.push("e", 0)
    assert fences == [0, 1, 2] and len(agent.writes) == 2
    assert [r.request_id for r in pusher.poll()] == ["e"]
    written.add(2)
    assert [r.request_id for r in pusher.poll()] == ["w"] and agent.writes[-1][0] is ready_w
    # Ended while waiting (abort, deadline): nothing is posted, the prepared WRITE is released.
    pusher.begin("a", "dec@1", 64, [8], [9], 10.0)
    pusher.push("a", 64)
    pusher.begin("x", "dec@1", 64, [10], [11], 1.0)
    pusher.push("x", 64)
    assert pusher.abort("a", "shutdown").status is PushStatus.FAILED
    clock.t = 2.0
    (res,) = pusher.poll()
    assert res.request_id == "x" and res.status is PushStatus.EXPIRED
    written.update({3, 4})
    assert pusher.poll() == [] and len(agent.writes) == 3 and not pusher.active
    # Every WRITE prepared at begin was posted ("w") or released unposted ("r": chunked; "a", "x").
    posted, unposted = {id(w[0]) for w in agent.writes}, {id(u) for u in agent.unposted}
    assert len(unposted) == 3 and all((id(x) in posted) != (id(x) in unposted) for x in agent.prepared)


def test_a_chunk_the_caller_knows_written_takes_no_fence_and_keeps_push_order():
    """``push(written=True)``: the caller waited for the device since its kernels were queued; no
    fence is taken and the WRITE goes at once, unless an earlier chunk still waits for its fence."""
    passed = {}

    def fence():
        token = len(passed)
        passed[token] = False
        return lambda: passed[token]

    agent = FakeAgent("pre@1", done_on_write=True)
    pusher = Pusher(agent, FakeBook(DEC), clock=Clock(), fence=fence)
    pusher.begin("w", "dec@1", 64, [0], [1], 10.0)
    pusher.push("w", 64, written=True)
    assert passed == {} and len(agent.writes) == 1
    pusher.begin("r", "dec@1", 192, [2, 3, 4], [5, 6, 7], 10.0)
    pusher.push("r", 64)  # fenced: waits
    pusher.push("r", 192, written=True)  # no fence of its own, but behind chunk 0
    assert list(passed) == [0] and len(agent.writes) == 1
    passed[0] = True
    assert {r.request_id for r in pusher.poll()} == {"w", "r"}
    assert [w[1].num_pages for w in agent.writes] == [1, 1, 2]


class SlowAgent(FakeAgent):
    """A WRITE turns DONE after ``checks`` state checks (the copies take that long)."""

    checks: int = 50

    def state(self, x):
        if x.state == "PROC":
            x.checks = getattr(x, "checks", 0) + 1
            if x.checks >= self.checks:
                x.state = "DONE"
        return x.state


def test_poll_spin_sees_a_write_end_in_the_same_call_and_is_bounded():
    agent, clock = SlowAgent("pre@1"), Clock()
    pusher = Pusher(agent, FakeBook(DEC), clock=clock)
    pusher.begin("r", "dec@1", 64, [0], [1], 10.0)
    pusher.push("r", 64)
    assert pusher.poll() == []  # one check: still copying
    (res,) = pusher.poll(spin_s=5.0)  # checks until DONE, then the bookkeeping
    assert res.status is PushStatus.DONE and agent.writes[0][0].checks == agent.checks
    # Nothing ends: the spin gives up after spin_s (real time, whatever the injected clock).
    agent.checks = 10**9
    pusher.begin("s", "dec@1", 64, [2], [3], 10.0)
    pusher.push("s", 64)
    t0 = time.perf_counter()
    assert pusher.poll(spin_s=0.02) == []
    assert 0.02 <= time.perf_counter() - t0 < 1.0
    assert pusher.poll(spin_s=0.02) == [] and pusher.active == ["s"]
    assert Pusher(agent, FakeBook(DEC), clock=clock).poll(spin_s=10.0) == []  # nothing in flight: returns at once


def test_a_waiting_write_to_a_forgotten_peer_is_never_posted():
    book = FakeBook(DEC)
    agent = FakeAgent("pre@1")
    pusher = Pusher(agent, book, clock=Clock(), fence=lambda: (lambda: True))
    pusher.begin("r", "dec@1", 64, [0], [1], 10.0, prepare=False)
    pusher.push("r", 64)  # the fence has passed: posted at once
    pusher.begin("s", "dec@1", 64, [2], [3], 10.0, prepare=False)
    pusher.fence = lambda: (lambda: False)  # this one's pages are still being written
    pusher.push("s", 64)
    assert len(agent.writes) == 1
    book.forget("dec@1")
    res = {r.request_id: r for r in pusher.poll()}
    assert set(res) == {"r", "s"} and all("forgotten" in r.reason for r in res.values())
    assert len(agent.writes) == 1 and agent.sent == []  # nothing posted to, or sent to, the gone peer


def test_a_write_whose_fence_passes_during_a_spin_is_not_posted_to_a_forgotten_peer():
    # The spin posts waiting chunks as their fences pass; it must not post to
    # a peer that was forgotten since the chunk was queued.
    book = FakeBook(DEC)
    agent = SlowAgent("pre@1")
    written = {"r": False}
    pusher = Pusher(agent, book, clock=Clock(), fence=lambda: (lambda: written["r"]))
    pusher.begin("q", "dec@1", 64, [4], [5], 10.0, prepare=False)
    pusher.fence = lambda: (lambda: True)
    pusher.push("q", 64)  # in flight: the spin has something to wait on
    pusher.fence = lambda: (lambda: written["r"])
    pusher.begin("r", "dec@1", 64, [0], [1], 10.0, prepare=False)
    pusher.push("r", 64)
    assert len(agent.writes) == 1
    book.forget("dec@1")
    written["r"] = True
    res = {r.request_id: r for r in pusher.poll(spin_s=5.0)}
    assert res["r"].status is PushStatus.FAILED and "forgotten" in res["r"].reason
    assert len(agent.writes) == 1 and agent.sent == []
