"""`Receiver.expect(..., peer_agent=None)`: the wait binds to the first handshaked
peer that pushes, with real NIXL agents (DRAM) in one process."""

from __future__ import annotations

import time

import pytest
import torch

from transfer import (
    CacheRegion,
    CompatInfo,
    PeerBook,
    Pusher,
    PushStatus,
    Receiver,
    ReceiveStatus,
    RequestCancelledError,
    TransferAgent,
)
from transfer.messages import ChunkDone

COMPAT = CompatInfo("test/model", 2, 64, "fp8_656", "fp8_132", True)
NUM_PAGES = 8


def _regions(fill: int | None = None):
    out = []
    for layer in range(2):
        for kind, bpp in (("mla", 96), ("index", 40)):
            t = torch.zeros(NUM_PAGES, bpp, dtype=torch.uint8)
            if fill is not None:
                t.fill_(fill + layer)
            out.append(CacheRegion.of(layer, kind, t))
    return out


class Side:
    """One agent with its regions, book, pusher and receiver."""

    def __init__(self, worker_id: str, fill: int | None = None):
        self.regions = _regions(fill)
        self.agent = TransferAgent(worker_id, self.regions, COMPAT)
        self.book = PeerBook(self.agent)
        self.pusher = Pusher(self.agent, self.book)
        self.released: list[tuple[int, ...]] = []  # pages the receiver gave back, in order
        self.receiver = Receiver(self.agent, self.book, release_pages=self.released.append)

    @property
    def name(self) -> str:
        return self.agent.name

    def close(self) -> None:
        self.agent.close()


def handshake(decode: Side, prefill: Side) -> None:
    decode.book.accept(prefill.book.respond(decode.book.offer().to_bytes()))


def poll_until(decode: Side, pushers: list[Side], timeout: float = 10.0):
    """Drive every pusher and decode's receiver until decode reports a result."""
    got, t_end = [], time.monotonic() + timeout
    while not got and time.monotonic() < t_end:
        for p in pushers:
            p.pusher.poll()
        got = decode.receiver.poll()
    assert got, "no receive result within the timeout"
    return got


@pytest.fixture
def sides():
    made: list[Side] = []

    def make(worker_id: str, fill: int | None = None) -> Side:
        s = Side(worker_id, fill)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_any_peer_wait_binds_to_the_pushing_peer_and_lands_pages(sides):
    dec, a, b = sides("dec"), sides("pre-a", fill=10), sides("pre-b", fill=50)
    handshake(dec, a)
    handshake(dec, b)
    dec.receiver.expect("r1", None, 100, [3, 4], 10.0)
    b.pusher.begin("r1", dec.name, 100, [0, 1], [3, 4], 10.0)
    b.pusher.push("r1", 100)
    (res,) = poll_until(dec, [b])
    assert res.status is ReceiveStatus.DONE and res.peer_agent == b.name and res.pages == (3, 4)
    for src, dst in zip(b.regions, dec.regions):
        assert torch.equal(dst.tensor[[3, 4]], src.tensor[[0, 1]])
    # A late notification of the same id from the other peer is ignored.
    before = dec.receiver.ignored_notifs
    a.agent.notify(dec.name, ChunkDone("r1", 0, count=1, pages=2))
    t_end = time.monotonic() + 5
    while dec.receiver.ignored_notifs == before and time.monotonic() < t_end:
        assert dec.receiver.poll() == []
    assert dec.receiver.ignored_notifs == before + 1


def test_bound_wait_ignores_other_peers_and_unknown_senders(sides):
    dec, a, b, stranger = sides("dec"), sides("pre-a", fill=1), sides("pre-b", fill=2), sides("pre-x", fill=3)
    handshake(dec, a)
    handshake(dec, b)
    # The stranger loaded decode's metadata (it can reach decode) but decode never accepted its offer.
    stranger.book.accept(dec.book.offer())
    dec.receiver.expect("r2", None, 130, [0, 1, 2], 10.0)
    stranger.agent.notify(dec.name, ChunkDone("r2", 0))          # not handshaked: ignored, no binding
    a.agent.notify(dec.name, ChunkDone("r2", 0))                 # binds to a (chunk 0 of ?)
    b.agent.notify(dec.name, ChunkDone("r2", 1, count=2, pages=3))  # another peer: ignored
    t_end = time.monotonic() + 5
    while dec.receiver.ignored_notifs < 2 and time.monotonic() < t_end:
        assert dec.receiver.poll() == []
    assert dec.receiver.ignored_notifs == 2
    a.agent.notify(dec.name, ChunkDone("r2", 1, count=2, pages=3))
    (res,) = poll_until(dec, [])
    assert res.status is ReceiveStatus.DONE and res.peer_agent == a.name and res.chunks == 2


def until(cond, drive, timeout: float = 10.0) -> None:
    """Call ``drive()`` until ``cond()`` (bounded)."""
    t_end = time.monotonic() + timeout
    while not cond() and time.monotonic() < t_end:
        drive()
        time.sleep(0.001)
    assert cond(), "condition not reached within the timeout"


def test_unbound_wait_ended_here_is_held_until_every_peer_settles(sides):
    dec, a, b = sides("dec"), sides("pre-a", fill=10), sides("pre-b", fill=50)
    handshake(dec, a)
    handshake(dec, b)
    dec.receiver.expect("c", None, 100, [3, 4], 10.0)
    a.pusher.begin("c", dec.name, 100, [0, 1], [3, 4], 10.0)
    a.pusher.push("c", 64)  # page 0 posted; decode has not read its notification
    res = dec.receiver.cancel("c", "client gone")
    # Still unbound: either handshaked peer may be the one writing.
    assert (res.status, res.peer_agent, res.held) == (ReceiveStatus.CANCELLED, None, True)
    assert dec.receiver.writers_of("c") == {a.name, b.name} and dec.released == []
    # b never had the request: it settles at once; a has not answered yet.
    until(lambda: dec.receiver.writers_of("c") == {a.name}, lambda: (b.pusher.poll(), dec.receiver.poll()))
    assert dec.receiver.held == {"c": (3, 4)} and dec.released == []
    # a reads the cancel, ends the push and settles once its WRITE is done.
    got = []
    until(lambda: dec.released, lambda: (got.extend(a.pusher.poll()), dec.receiver.poll()))
    assert [(r.request_id, r.status) for r in got] == [("c", PushStatus.CANCELLED)]
    assert dec.released == [(3, 4)] and dec.receiver.held == {} and not dec.receiver.has_work
    # Neither may push it later: decode may have re-used the pages.
    for side in (a, b):
        with pytest.raises(RequestCancelledError):
            side.pusher.begin("c", dec.name, 100, [0, 1], [3, 4], 10.0)


def test_unbound_wait_expiry_and_peer_loss(sides):
    dec, a = sides("dec"), sides("pre-a")
    handshake(dec, a)
    dec.receiver.expect("e", None, 10, [5], 0.0)
    time.sleep(0.01)
    (res,) = dec.receiver.poll()
    assert (res.status, res.peer_agent, res.held) == (ReceiveStatus.EXPIRED, None, True)
    until(lambda: dec.released == [(5,)], lambda: (a.pusher.poll(), dec.receiver.poll()))
    # peer_lost and forgetting a peer leave unbound waits alone; a bound wait
    # fails with its peer and its pages come back at once (the peer is gone).
    dec.receiver.expect("u", None, 10, [6], 10.0)
    dec.receiver.expect("b", None, 10, [7], 10.0)
    a.agent.notify(dec.name, ChunkDone("b", 0))  # binds "b" to a
    t_end = time.monotonic() + 5
    while time.monotonic() < t_end:
        dec.receiver.poll()
        if dec.receiver.peer_of("b") is not None:
            break
    assert dec.receiver.peer_of("b") == a.name and dec.receiver.peer_of("u") is None
    assert dec.receiver.peer_lost("pre-a@0") == []
    dec.book.forget(a.name)
    (res,) = dec.receiver.poll()
    assert (res.request_id, res.status, res.peer_agent, res.held) == ("b", ReceiveStatus.FAILED, a.name, False)
    assert dec.released == [(5,), (7,)]
    assert dec.receiver.active == ["u"]
    with pytest.raises(ValueError, match="already used"):
        dec.receiver.expect("b", None, 10, [6], 10.0)
