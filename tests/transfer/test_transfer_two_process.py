"""Real NIXL over DRAM between two spawned processes (prefill pushes, decode receives).

Page contents are random bytes; after a push, every decode region must equal
its starting bytes with exactly the reserved pages replaced by the prefill
pages paired with them. Every test ends with both page pools at their
starting free counts.
"""

from __future__ import annotations

import time

import pytest

from attention.formats import pages_for_tokens
from tests.transfer.transfer_harness import Geometry, RemoteError, WorkerProc, handshake

GEOM = Geometry()
DEC_PAGES, PRE_PAGES = 64, 48


def _bpp(kind: str) -> int:
    return {"mla": GEOM.mla_bytes, "index": GEOM.index_bytes, GEOM.state_kind: GEOM.state_bytes}[kind]


def expected_decode(before: dict, prefill: dict, pairs: list[tuple[list[int], list[int]]]) -> dict:
    """Decode regions after copying prefill page ``lp[i]`` onto decode page ``rp[i]`` for every pair."""
    out = {}
    for key, raw in before.items():
        buf = bytearray(raw)
        bpp = _bpp(key[1])
        for lp, rp in pairs:
            for l, r in zip(lp, rp):
                buf[r * bpp : (r + 1) * bpp] = prefill[key][l * bpp : (l + 1) * bpp]
        out[key] = bytes(buf)
    return out


def assert_regions_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        if got[key] != want[key]:
            bpp = _bpp(key[1])
            bad = [p for p in range(len(want[key]) // bpp) if got[key][p * bpp : (p + 1) * bpp] != want[key][p * bpp : (p + 1) * bpp]]
            pytest.fail(f"region {key}: pages {bad} differ")


@pytest.fixture(scope="module", params=[True, False], ids=["prefill-progress-thread", "prefill-polls-only"])
def pair(request):
    # A GPU prefill agent runs without NIXL's progress thread (workers.push_tuning): every case
    # runs both ways. Decode always keeps it.
    dec = WorkerProc("dec0", GEOM, DEC_PAGES, seed=1)
    pre = WorkerProc("pre0", GEOM, PRE_PAGES, seed=2, progress_thread=request.param)
    try:
        dec.ready()
        pre.ready()
        handshake(dec, pre)
        yield dec, pre
    finally:
        dec.close()
        pre.close()


def settle(dec: WorkerProc, pre: WorkerProc, timeout_s: float = 10.0) -> None:
    """Drive both sides until decode holds no pages (prefill answered every cancel)."""
    t_end = time.monotonic() + timeout_s
    while dec.call("held") and time.monotonic() < t_end:
        pre.call("poll_push", 0.02, until_idle=False)
        dec.call("settle", 0.02)
    assert dec.call("held") == {}, "decode still holds pages of cancelled requests"


@pytest.fixture
def pools_restored(pair):
    """Both pools must be back at their starting free counts after the test (once prefill settled)."""
    dec, pre = pair
    start = dec.call("free_count"), pre.call("free_count")
    yield
    settle(dec, pre)
    assert (dec.call("free_count"), pre.call("free_count")) == start


def test_scattered_pages_many_layers_all_kinds_land_exactly(pair, pools_restored):
    dec, pre = pair
    pre_name = pre.call("name")
    before, pre_snap = dec.call("snapshot"), pre.call("snapshot")
    # Page-aligned, unaligned, single-token and long prompts, pushed
    # interleaved in 200-token chunks (chunk ends mid-page).
    lens = {"a": 1000, "b": 320, "c": 1, "d": 1500}
    reserved = {rid: dec.call("reserve", rid, pre_name, n, 20.0) for rid, n in lens.items()}
    assert {rid: len(p) for rid, p in reserved.items()} == {rid: pages_for_tokens(n) for rid, n in lens.items()}
    dec_name = dec.call("name")
    pre.send("push", [(rid, dec_name, n, reserved[rid]) for rid, n in lens.items()], 200, 20.0)
    dec.send("wait", 20.0)
    pushed, received = pre.recv(40), dec.recv(40)

    assert {rid: r["status"] for rid, r in pushed.items()} == dict.fromkeys(lens, "done")
    assert sorted(r["request_id"] for r in received) == sorted(lens)
    assert all(r["status"] == "done" for r in received), received
    # ceil(n / 200) chunks; a 1-token prompt is one chunk.
    assert {rid: r["chunks"] for rid, r in pushed.items()} == {rid: -(-n // 200) for rid, n in lens.items()}
    pairs = [(pushed[rid]["pages"], reserved[rid]) for rid in lens]
    assert_regions_equal(dec.call("snapshot"), expected_decode(before, pre_snap, pairs))
    assert pre.call("snapshot") == pre_snap  # pushing never writes the source
    for pages in reserved.values():
        dec.call("release", pages)


def test_decode_deadline_expiry_frees_both_sides_and_ignores_late_notifs(pair, pools_restored):
    dec, pre = pair
    pre_name, dec_name = pre.call("name"), dec.call("name")
    n = 700
    pages = dec.call("reserve", "slow", pre_name, n, 1.0)
    pre.send("push", [("slow", dec_name, n, pages)], 128, 30.0, pause_after_chunk=0)
    assert pre.recv_tagged(30)[0] == "paused"  # chunk 0 landed, prefill stalls
    t0 = time.monotonic()
    free_before = dec.call("free_count")
    got = dec.call("wait", 10.0)
    assert [(r["request_id"], r["status"], r["chunks"], r["held"]) for r in got] == [("slow", "expired", 1, True)]
    assert time.monotonic() - t0 < 5.0
    # Prefill has not answered the cancel (it is paused): the pages stay out of the pool.
    assert dec.call("held") == {"slow": pages} and dec.call("free_count") == free_before
    pre.conn.send("resume")
    pushed = pre.recv(30)
    assert pushed["slow"]["status"] == "cancelled", pushed  # decode's cancel reached prefill
    # A late notification for the dead request changes nothing; prefill's
    # answer to the cancel (read in the same polls) gives the pages back.
    ignored = dec.call("ignored_notifs")
    pre.call("notify_chunk", dec_name, "slow", 5, 6, len(pages))
    assert dec.call("wait", 0.5, until_idle=False) == []
    assert dec.call("ignored_notifs") == ignored + 1
    assert dec.call("held") == {} and dec.call("free_count") == free_before + len(pages)


def test_prefill_deadline_expiry_aborts_decode(pair, pools_restored):
    dec, pre = pair
    pre_name, dec_name = pre.call("name"), dec.call("name")
    n = 500
    pages = dec.call("reserve", "stuck", pre_name, n, 30.0)
    pre.send("push", [("stuck", dec_name, n, pages)], 128, 0.5, pause_after_chunk=0)
    assert pre.recv_tagged(30)[0] == "paused"
    time.sleep(0.8)
    pre.conn.send("resume")
    pushed = pre.recv(30)
    assert pushed["stuck"]["status"] == "expired", pushed
    got = dec.call("wait", 10.0)
    assert [(r["status"], r["reason"].startswith("prefill aborted")) for r in got] == [("failed", True)]


def test_prefill_killed_mid_transfer_decode_expires_and_frees(pair, pools_restored):
    dec, pre = pair
    victim = WorkerProc("pre-victim", GEOM, PRE_PAGES, seed=3, progress_thread=pre.progress_thread)
    try:
        victim.ready()
        handshake(dec, victim)
        v_name, dec_name = victim.call("name"), dec.call("name")
        reqs = [(rid, dec_name, n, dec.call("reserve", rid, v_name, n, 1.5)) for rid, n in (("k1", 900), ("k2", 300))]
        victim.send("push", reqs, 128, 30.0, pause_after_chunk=0)
        assert victim.recv_tagged(30)[0] == "paused"
        victim.kill()
        got = dec.call("wait", 10.0)
        assert sorted((r["request_id"], r["status"], r["chunks"], r["held"]) for r in got) == [
            ("k1", "expired", 1, True), ("k2", "expired", 1, True)]
        # Nobody has said the victim is dead: its WRITEs could still land, so
        # the pages stay held (the cancel to a dead process is never answered).
        assert sorted(dec.call("held")) == ["k1", "k2"]
        assert dec.call("settle", 1.5) != {}
        # Declared dead (Serve: it left the peer directory): nothing more can land.
        dec.call("peer_lost", v_name)
        assert dec.call("held") == {}
    finally:
        victim.kill()


def test_decode_killed_mid_transfer_prefill_fails_and_frees(pair, pools_restored):
    _, pre = pair
    victim = WorkerProc("dec-victim", GEOM, DEC_PAGES, seed=4)
    try:
        victim.ready()
        handshake(victim, pre)
        pre_name, v_name = pre.call("name"), victim.call("name")
        pages = victim.call("reserve", "orphan", pre_name, 1000, 30.0)
        pre.send("push", [("orphan", v_name, 1000, pages)], 128, 30.0, pause_after_chunk=0)
        assert pre.recv_tagged(30)[0] == "paused"
        victim.kill()
        pre.conn.send("resume")
        pushed = pre.recv(30)
        assert pushed["orphan"]["status"] == "failed", pushed
        assert pushed["orphan"]["chunks"] == 1
    finally:
        victim.kill()


def test_late_write_lands_only_in_held_pages_until_prefill_settles(pair, pools_restored):
    """A WRITE posted after decode's deadline must not reach pages given to another request.

    Prefill posts chunk 0, decode's deadline passes, and prefill (which has not
    read decode's cancel yet) posts the rest of the dead request. Its bytes
    land, but only in the dead request's pages, which decode keeps out of its
    pool: a new request reserved next gets other pages, and its own push lands
    intact. The held pages return once prefill answers the cancel.
    """
    dec, pre = pair
    pre_name, dec_name = pre.call("name"), dec.call("name")
    dec_start = dec.call("free_count")
    before, pre_snap = dec.call("snapshot"), pre.call("snapshot")
    n_late, n_fresh = 700, 300
    late = dec.call("reserve", "late", pre_name, n_late, 0.5)
    late_src = pre.call("begin_push", "late", dec_name, n_late, late, 30.0)
    assert pre.call("post", "late", 128)  # chunk 0 (pages 0-1) landed
    got = dec.call("wait", 10.0)
    assert [(r["request_id"], r["status"], r["chunks"], r["held"]) for r in got] == [("late", "expired", 1, True)]
    # Held: out of the free list.
    assert dec.call("held") == {"late": late}
    assert dec.call("free_count") == dec_start - len(late)

    # The late WRITE: the rest of the dead request, posted before prefill reads
    # decode's cancel (prefill reads cancels only when it polls or begins a
    # push, and does neither in between: no race with the cancel's arrival).
    ignored = dec.call("ignored_notifs")
    assert pre.call("post", "late", n_late)
    assert dec.call("wait", 0.3, until_idle=False) == []
    assert dec.call("ignored_notifs") == ignored + 1  # its ChunkDone is a late notification
    assert dec.call("held") == {"late": late}  # still no answer from prefill

    # A new request cannot get the held pages; its push lands in its own.
    fresh = dec.call("reserve", "fresh", pre_name, n_fresh, 30.0)
    assert not set(fresh) & set(late)
    assert dec.call("free_count") == dec_start - len(late) - len(fresh)
    fresh_src = pre.call("begin_push", "fresh", dec_name, n_fresh, fresh, 30.0)
    assert pre.call("post", "fresh", n_fresh)
    assert [(r["request_id"], r["status"]) for r in dec.call("wait", 10.0)] == [("fresh", "done")]
    # Every late byte landed in the held pages; the fresh request's pages hold its own.
    assert_regions_equal(dec.call("snapshot"), expected_decode(before, pre_snap, [(late_src, late), (fresh_src, fresh)]))

    # Prefill reads the cancel: the late request ends CANCELLED, nothing is in
    # flight, so it settles at once and decode gives the pages back.
    pushed = pre.call("poll_push", 10.0)
    assert {rid: r["status"] for rid, r in pushed.items()} == {"late": "cancelled", "fresh": "done"}
    assert dec.call("settle", 10.0) == {}
    assert dec.call("free_count") == dec_start - len(fresh)
    dec.call("release", fresh)


def test_cancel_before_prefill_begins_is_settled_and_the_request_refused(pair, pools_restored):
    dec, pre = pair
    pre_name, dec_name = pre.call("name"), dec.call("name")
    pages = dec.call("reserve", "early", pre_name, 200, 0.2)
    assert [r["held"] for r in dec.call("wait", 10.0)] == [True]
    pre.call("poll_push", 0.5, until_idle=False)  # prefill answers a cancel of a request it never had
    assert dec.call("settle", 10.0) == {}
    # Decode may re-use the pages now, so a late task for that request must not push.
    with pytest.raises(RemoteError) as err:
        pre.call("begin_push", "early", dec_name, 200, pages, 30.0)
    assert err.value.type_name == "RequestCancelledError"


def test_restarted_decode_is_rehandshaked_never_served_stale(pair):
    _, pre = pair
    pre_name = pre.call("name")
    pre_free = pre.call("free_count")
    first = WorkerProc("dec-r", GEOM, DEC_PAGES, seed=5)
    second = None
    try:
        first.ready()
        handshake(first, pre)
        old_name, old_offer = first.call("name"), first.call("offer")
        pages = first.call("reserve", "r0", pre_name, 300, 20.0)
        assert pre.call("push", [("r0", old_name, 300, pages)], 300, 20.0)["r0"]["status"] == "done"
        first.kill()

        second = WorkerProc("dec-r", GEOM, DEC_PAGES, seed=6).ready()
        new_name = second.call("name")
        assert new_name != old_name and new_name.startswith("dec-r@")
        before, pre_snap = second.call("snapshot"), pre.call("snapshot")
        # Prefill has only the dead epoch's metadata: a request naming the new
        # epoch must be refused, not pushed with the old metadata.
        with pytest.raises(RemoteError) as err:
            pre.call("push", [("r1", new_name, 450, list(range(pages_for_tokens(450))))], 128, 20.0)
        assert err.value.type_name == "UnknownPeerError"
        assert pre.call("free_count") == pre_free
        # ... and the new decode cannot expect pages from a prefill it has not handshaked.
        with pytest.raises(RemoteError) as err:
            second.call("reserve", "r1", pre_name, 450, 20.0)
        assert err.value.type_name == "UnknownPeerError"

        handshake(second, pre)
        pages = second.call("reserve", "r1b", pre_name, 450, 20.0)
        assert pre.call("knows", new_name) and not pre.call("knows", old_name)
        assert old_name not in pre.call("peer_names")
        second.send("wait", 20.0)
        pushed = pre.call("push", [("r1b", new_name, 450, pages)], 128, 20.0)
        assert pushed["r1b"]["status"] == "done"
        assert [r["status"] for r in second.recv(30)] == ["done"]
        assert_regions_equal(second.call("snapshot"), expected_decode(before, pre_snap, [(pushed["r1b"]["pages"], pages)]))
        # A delayed offer from the dead epoch cannot replace the live one.
        with pytest.raises(RemoteError) as err:
            pre.call("accept", old_offer)
        assert err.value.type_name == "StaleEpochError"
        assert pre.call("knows", new_name)
        second.call("release", pages)
        assert second.call("free_count") == DEC_PAGES
        assert pre.call("free_count") == pre_free
    finally:
        first.kill()
        if second is not None:
            second.close()


def test_handshake_mismatch_names_the_differing_fields(pair):
    _, pre = pair
    other = WorkerProc("dec-m", Geometry(has_mtp=False, num_layers=4), DEC_PAGES, seed=7)
    try:
        other.ready()
        with pytest.raises(RemoteError) as err:
            pre.call("respond", other.call("offer"))
        assert err.value.type_name == "CompatibilityError"
        msg = str(err.value)
        assert "has_mtp: local=True remote=False" in msg
        assert "num_layers: local=5 remote=4" in msg
        assert "regions[layer=4,kind=mla]" in msg
        with pytest.raises(RemoteError) as err:
            other.call("accept", pre.call("offer"))
        assert "has_mtp: local=False remote=True" in str(err.value)
        assert not pre.call("knows", other.call("name"))
    finally:
        other.close()
