"""Handshake and peer book with real NIXL agents in one process, and a push between
two `attention.cache.PagedKVCache`s through their ``regions()`` (the integration seam)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from transfer import (
    CacheRegion,
    CompatibilityError,
    CompatInfo,
    HandshakeOffer,
    PeerBook,
    Pusher,
    Receiver,
    StaleEpochError,
    TransferAgent,
    TransferError,
    UnknownPeerError,
)
from transfer.regions import RegionTable

COMPAT = CompatInfo("test/model", 2, 64, "fp8_656", "fp8_132", True)


def regions(num_pages: int, index_bytes: int = 40):
    return [CacheRegion.of(layer, kind, torch.zeros(num_pages, bpp, dtype=torch.uint8))
            for layer in range(2) for kind, bpp in (("mla", 96), ("index", index_bytes))]


@pytest.fixture(scope="module")
def prefill():
    agent = TransferAgent("pre", regions(8), COMPAT)
    yield PeerBook(agent)
    agent.close()


def test_offer_roundtrip_and_idempotent_accept(prefill):
    dec = TransferAgent("dec-a", regions(12), COMPAT)
    book = PeerBook(dec)
    offer = book.offer()
    assert HandshakeOffer.from_bytes(offer.to_bytes()) == offer
    peer = PeerBook.accept(prefill, offer.to_bytes())
    assert peer.agent_name == dec.name == f"dec-a@{dec.epoch}"
    assert prefill.accept(offer) is peer  # same epoch again: no reload
    book.accept(prefill.offer())
    assert prefill.get(dec.name).regions == dec.table
    with pytest.raises(TransferError, match="malformed"):
        HandshakeOffer.from_bytes(b"{}")
    prefill.forget(dec.name)
    assert not prefill.knows(dec.name)
    dec.close()


@pytest.mark.parametrize(
    "change, field",
    [({"num_layers": 3}, "num_layers"), ({"has_mtp": False}, "has_mtp"), ({"page_size": 256}, "page_size"),
     ({"kv_format": "bf16_576"}, "kv_format"), ({"model": "other"}, "model")],
)
def test_mismatch_is_refused_naming_the_field(prefill, change, field):
    dec = TransferAgent("dec-m", regions(12), dataclasses.replace(COMPAT, **change))
    with pytest.raises(CompatibilityError) as err:
        prefill.respond(PeerBook(dec).offer().to_bytes())
    assert err.value.fields == (field,) and field in str(err.value)
    assert not prefill.knows(dec.name)
    dec.close()


def test_region_geometry_mismatch_is_refused(prefill):
    dec = TransferAgent("dec-g", regions(12, index_bytes=44), COMPAT)
    with pytest.raises(CompatibilityError, match=r"regions\[layer=0,kind=index\]\.bytes_per_page: local=40 remote=44"):
        prefill.accept(PeerBook(dec).offer())
    dec.close()


def test_restart_replaces_old_epoch_and_refuses_stale_offers(prefill):
    first = TransferAgent("dec-r", regions(12), COMPAT)
    old_offer = PeerBook(first).offer()
    prefill.accept(old_offer)
    second = TransferAgent("dec-r", regions(12), COMPAT)
    assert second.epoch > first.epoch and second.name != first.name
    with pytest.raises(UnknownPeerError, match="handshake again"):
        prefill.get(second.name)
    prefill.accept(PeerBook(second).offer())
    assert prefill.get(second.name).epoch == second.epoch
    with pytest.raises(UnknownPeerError, match="known epoch"):
        prefill.get(first.name)
    with pytest.raises(StaleEpochError):
        prefill.accept(old_offer)
    assert [p.agent_name for p in prefill.peers() if p.worker_id == "dec-r"] == [second.name]
    prefill.forget(second.name)
    first.close()
    second.close()


def test_peer_descriptor_lists_are_prepared_at_handshake_and_dropped_with_the_peer(prefill):
    first = TransferAgent("dec-p", regions(12), COMPAT)
    peer = prefill.accept(PeerBook(first).offer())
    assert prefill.agent.is_prepared(peer.agent_name)
    second = TransferAgent("dec-p", regions(12), COMPAT)  # the same worker restarted
    prefill.accept(PeerBook(second).offer())
    assert not prefill.agent.is_prepared(first.name) and prefill.agent.is_prepared(second.name)
    prefill.forget(second.name)
    assert not prefill.agent.is_prepared(second.name)
    first.close()
    second.close()


def test_indexed_write_needs_the_prepared_list_of_that_table(prefill):
    from transfer import RegionSelection, index_plan

    dec = TransferAgent("dec-w", regions(12), COMPAT)
    name = prefill.agent.load_peer(dec.metadata())  # metadata only: no PeerBook, nothing prepared
    plan = index_plan(RegionSelection.of(prefill.agent.table, dec.table), [0], [0])
    with pytest.raises(UnknownPeerError, match="prepared"):
        prefill.agent.write(name, plan, b"")
    prefill.agent.prepare_peer(name, dec.table)
    other = RegionTable(tuple(dataclasses.replace(e, base_addr=e.base_addr + 1) for e in dec.table))
    stale = index_plan(RegionSelection.of(prefill.agent.table, other), [0], [0])
    with pytest.raises(ValueError, match="another region table"):
        prefill.agent.write(name, stale, b"")
    prefill.agent.drop_peer(name)
    assert not prefill.agent.is_prepared(name)
    dec.close()


@pytest.mark.parametrize("layout", ["cross_layer", "per_layer"])
def test_push_between_paged_kv_caches_through_regions(layout):
    """`PagedKVCache.regions()` objects are registered and pushed as they come: through the prepared
    lists (merged and not) and through explicit descriptors (whole runs and cut to one page)."""
    cache_mod = pytest.importorskip("attention.cache")
    spec = cache_mod.CacheSpec(num_layers=3, num_pages=12, kv_lora_rank=64, rope_dim=16, index_head_dim=32,
                               kv_cache_dtype="fp8", dtype=torch.bfloat16, indexer_layers=(True, False, True),
                               page_layout=layout)
    src, dst = cache_mod.PagedKVCache(spec, "cpu"), cache_mod.PagedKVCache(spec, "cpu")
    for r in src.regions():
        r.tensor.copy_(torch.randint(0, 256, r.tensor.shape, dtype=torch.uint8))
    compat = dataclasses.replace(COMPAT, num_layers=3)
    pa, da = TransferAgent("pre-kv", src.regions(), compat), TransferAgent("dec-kv", dst.regions(), compat)
    # per_layer: one region per layer (its pages hold the MLA bytes, then the indexer bytes where the
    # layer has one); cross_layer: one region whose page holds every layer's.
    keys = [(0, "kv"), (1, "kv"), (2, "kv")] if layout == "per_layer" else [(-1, "kv")]
    assert pa.table.keys() == keys
    k = len(keys)
    pb, db = PeerBook(pa), PeerBook(da)
    db.accept(pb.respond(db.offer().to_bytes()))
    # Every request must end DONE: none of its pages may come back as released.
    receiver = Receiver(da, release_pages=lambda pages: pytest.fail(f"pages {pages} released"))
    requests = {  # request id: (pusher, prompt length, prefill pages, decode pages)
        "prep": (Pusher(pa, pb, path="prepared"), 150, [0, 1, 5], [7, 2, 3]),
        "init": (Pusher(pa, pb, path="explicit"), 128, [2, 3], [0, 1]),
        "flat": (Pusher(pa, pb, merge=False), 150, [6, 7, 8], [4, 5, 6]),
        "cut": (Pusher(pa, pb, path="explicit", run_pages=1), 150, [9, 10, 11], [8, 9, 10]),
    }
    for rid, (pusher, n, lp, rp) in requests.items():
        receiver.expect(rid, pa.name, n, rp, 10.0)
        pusher.begin(rid, da.name, n, lp, rp, 10.0)
        pusher.push(rid, 64)
        pusher.push(rid, n)
    pushed, got, t_end = [], [], time.monotonic() + 10
    while (len(pushed) < 4 or len(got) < 4) and time.monotonic() < t_end:
        for pusher, *_ in requests.values():
            pushed += pusher.poll()
        got += receiver.poll()
    done = [("cut", "done"), ("flat", "done"), ("init", "done"), ("prep", "done")]
    assert sorted((r.request_id, r.status.value) for r in pushed) == done
    assert sorted((r.request_id, r.status.value) for r in got) == done
    stats = {rid: p.stats for rid, (p, *_) in requests.items()}
    assert stats["flat"].descriptors == k * 3 and stats["prep"].descriptors == k * (1 + 2)
    # Two chunks each: pages 2 | 3; and 9 | 10-11, the run cut into single pages.
    assert stats["init"].descriptors == k * 2 and stats["cut"].descriptors == k * 3
    for s, d in zip(src.regions(), dst.regions()):
        for _, _, lp, rp in requests.values():
            assert torch.equal(d.tensor[rp], s.tensor[lp])
        assert not d.tensor[[11]].any()  # the one decode page no request owns
    pa.close()
    da.close()
