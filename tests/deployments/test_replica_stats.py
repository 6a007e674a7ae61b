"""Replica stats cross Ray as plain dicts and come back as the typed snapshot; a misspelt or
missing field is an error at the boundary, never a silent 0."""

from __future__ import annotations

import dataclasses

import pytest

from deployments.peer_directory import PeerDirectory
from deployments.replica_stats import DecodeStats, PrefillStats, stats_class


def _decode(**kw) -> DecodeStats:
    base = {f.name: 0 for f in dataclasses.fields(DecodeStats)}
    return DecodeStats(**{**base, "agent": "decode-x@1", "mtp_acceptance_rate": 0.0, **kw})


def _prefill(**kw) -> PrefillStats:
    base = {f.name: 0 for f in dataclasses.fields(PrefillStats)}
    return PrefillStats(**{**base, "agent": "prefill-x@1", **kw})


def test_round_trip_through_the_wire_form():
    d = _decode(free_pages=7, total_pages=9, queued=2, awaiting_kv=3, known_prefills=1)
    assert DecodeStats.from_dict(d.to_dict()) == d
    assert d.waiting == 5  # queued + awaiting KV: the queue-depth gauge
    p = _prefill(active=1, queued=4, queued_tokens=300)
    assert stats_class("prefill").from_dict(p.to_dict()) == p and p.waiting == 4


def test_a_misspelt_or_missing_field_is_refused_by_name():
    wire = _decode().to_dict()
    wire["known_prefils"] = wire.pop("known_prefills")
    with pytest.raises(TypeError, match=r"unknown fields \['known_prefils'\], missing fields \['known_prefills'\]"):
        DecodeStats.from_dict(wire)
    with pytest.raises(TypeError, match="missing fields"):
        PrefillStats.from_dict(_decode().to_dict())  # a decode report read as a prefill one


def test_routing_stats_before_the_first_report_read_as_none():
    assert DecodeStats.from_routing({}) is None and DecodeStats.from_routing(None) is None
    assert DecodeStats.from_routing(_decode(requests=3).to_dict()).requests == 3


def test_the_directory_refuses_a_malformed_heartbeat_and_keeps_good_ones():
    d = PeerDirectory()
    good = _prefill(free_pages=4, total_pages=4).to_dict()
    assert d.publish("prefill", "p1", "prefill-x@1", b"offer", good)
    with pytest.raises(TypeError, match="unknown fields"):
        d.publish("prefill", "p1", "prefill-x@1", None, {**good, "free_page": 1})
    assert d.snapshot()["prefill"][0]["stats"] == good


def test_a_replica_without_a_link_is_listed_but_never_handed_to_a_peer():
    # A monolithic decode replica publishes no offer: /stats and /health see it, no peer handshakes with it.
    d = PeerDirectory()
    assert not d.publish("decode", "d1", "d1", None, _decode(agent="d1").to_dict())
    assert [e["worker_id"] for e in d.snapshot()["decode"]] == ["d1"] and d.snapshot()["prefill"] == []
    assert d.entries("decode") == []
    assert d.publish("decode", "d2", "decode-y@1", b"offer", _decode().to_dict())
    assert [e["worker_id"] for e in d.entries("decode")] == ["d2"]
