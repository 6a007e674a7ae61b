"""Region tables, transfer plans, compatibility diff and the notification codec (no NIXL)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transfer import (
    CacheRegion,
    CompatInfo,
    PlanError,
    RegionError,
    RegionSelection,
    build_plan,
    finished_pages,
    index_plan,
    region_table,
)
from transfer import messages
from transfer.compat import check_compatible, diff_compat
from transfer.errors import CompatibilityError
from transfer.regions import RegionEntry, RegionTable


def table(base: int, num_pages: int, layers: int = 2, kinds=(("mla", 100), ("index", 40)), gap: int = 4096):
    """A synthetic DRAM table: region i at ``base + i * (num_pages * 1000 + gap)``."""
    entries, addr = [], base
    for layer in range(layers):
        for kind, bpp in kinds:
            entries.append(RegionEntry(layer, kind, addr, bpp, num_pages, "DRAM", 0))
            addr += num_pages * 1000 + gap
    return RegionTable(tuple(entries))


def reference_rows(local, remote, lp, rp):
    """One (src, dst, len) per (region, page): the unmerged truth."""
    rows = []
    for le in local:
        re_ = remote.get(le.layer, le.kind)
        rows += [(le.page_addr(l), re_.page_addr(r), le.bytes_per_page) for l, r in zip(lp, rp)]
    return rows


def expand(plan):
    """A plan's descriptors as (src, dst, len) rows (both sides have equal lengths)."""
    assert (plan.src[:, 1] == plan.dst[:, 1]).all()
    return [(int(s), int(d), int(n)) for (s, n, _), (d, _, _) in zip(plan.src, plan.dst)]


def covered(rows, unit):
    """The (src, dst) address pairs of every ``unit``-byte block the rows copy (unit divides every length)."""
    out = set()
    for s, d, n in rows:
        out |= {(s + o, d + o) for o in range(0, n, unit)}
    return out


# -- regions -------------------------------------------------------------------


def test_region_table_from_tensors():
    a = torch.zeros(8, 3, 10, dtype=torch.uint8)
    b = torch.zeros(8, 64, dtype=torch.bfloat16)
    t = region_table([CacheRegion.of(0, "mla", a), CacheRegion.of(0, "index", b), CacheRegion.of(1, "swa", a[:, 0].clone())])
    assert [(e.layer, e.kind, e.bytes_per_page, e.num_pages, e.mem_type) for e in t] == [
        (0, "mla", 30, 8, "DRAM"), (0, "index", 128, 8, "DRAM"), (1, "swa", 10, 8, "DRAM")]
    assert t.get(0, "index").base_addr == b.data_ptr()
    assert RegionTable.from_wire(t.to_wire()) == t


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda: CacheRegion(0, "mla", torch.zeros(8, 4, 10, dtype=torch.uint8).transpose(1, 2), 40, 8), "contiguous"),
        (lambda: CacheRegion(0, "mla", torch.zeros(8, 40, dtype=torch.uint8), 41, 8), "bytes"),
        (lambda: CacheRegion(0, "mla", torch.zeros(8, 40, dtype=torch.uint8), 40, 9), "dim 0"),
        (lambda: CacheRegion(0, "", torch.zeros(8, 40, dtype=torch.uint8), 40, 8), "kind"),
    ],
)
def test_region_validation(bad, match):
    with pytest.raises(RegionError, match=match):
        region_table([bad()])


def test_region_table_rejects_duplicates_and_overlap():
    t = torch.zeros(8, 40, dtype=torch.uint8)
    with pytest.raises(RegionError, match="duplicate"):
        region_table([CacheRegion.of(0, "mla", t), CacheRegion.of(0, "mla", torch.zeros_like(t))])
    with pytest.raises(RegionError, match="overlap"):
        region_table([CacheRegion.of(0, "mla", t), CacheRegion.of(1, "mla", t.view(-1)[40:].view(7, 40))])


# -- plans ----------------------------------------------------------------------


def test_plan_merges_runs_contiguous_on_both_sides_only():
    local, remote = table(1 << 20, 32), table(1 << 30, 48)
    lp = [0, 1, 2, 3, 10, 11, 20, 21]
    rp = [5, 6, 7, 9, 12, 13, 40, 30]
    #      run---  x   run----  x
    plan = build_plan(local, remote, lp, rp)
    # Per region: [0-2 -> 5-7], [3 -> 9], [10-11 -> 12-13], [20 -> 40], [21 -> 30].
    assert plan.num_descriptors == 4 * 5
    first = plan.src[:5, 1].tolist()
    assert first == [300, 100, 200, 100, 100]
    assert plan.nbytes == 8 * (100 + 40) * 2
    assert covered(expand(plan), 20) == covered(reference_rows(local, remote, lp, rp), 20)


def test_plan_without_merging_is_one_descriptor_per_region_page():
    local, remote = table(1 << 20, 16), table(1 << 30, 16)
    lp = rp = list(range(16))
    merged = build_plan(local, remote, lp, rp)
    flat = build_plan(local, remote, lp, rp, merge=False)
    assert merged.num_descriptors == 4 and flat.num_descriptors == 64
    assert [tuple(map(int, r)) for r in zip(flat.src[:, 0], flat.dst[:, 0], flat.src[:, 1])] == reference_rows(local, remote, lp, rp)
    assert merged.nbytes == flat.nbytes


def test_plan_merges_page_runs_within_each_region_only():
    # Regions packed back to back (gap 0): a run never spans two regions, even where their
    # bytes happen to be adjacent on both sides (one descriptor per region and page run).
    local = table(1 << 20, 8, kinds=(("mla", 1000),), gap=0)
    remote = table(1 << 30, 8, kinds=(("mla", 1000),), gap=0)
    plan = build_plan(local, remote, list(range(8)), list(range(8)))
    assert plan.num_descriptors == 2 and plan.nbytes == 2 * 8 * 1000
    assert plan.src[:, 1].tolist() == [8 * 1000] * 2


def test_plan_random_scattered_pages_match_reference():
    rng = np.random.default_rng(0)
    local, remote = table(1 << 20, 64, layers=3), table(1 << 32, 96, layers=3)
    for _ in range(20):
        n = int(rng.integers(0, 40))
        lp = rng.choice(64, n, replace=False)
        rp = np.sort(rng.choice(96, n, replace=False)) if rng.random() < 0.5 else rng.choice(96, n, replace=False)
        plan = build_plan(local, remote, lp, rp)
        assert plan.num_pages == n and plan.nbytes == n * 140 * 3
        assert covered(expand(plan), 20) == covered(reference_rows(local, remote, lp.tolist(), rp.tolist()), 20)
        assert (plan.src[:, 1] == plan.dst[:, 1]).all()


def test_plan_layer_and_kind_selection():
    local, remote = table(1 << 20, 8, layers=3), table(1 << 30, 8, layers=3)
    plan = build_plan(local, remote, [1], [2], layers=[2], kinds=["index"])
    assert plan.num_descriptors == 1
    assert int(plan.dst[0, 0]) == remote.get(2, "index").page_addr(2)
    with pytest.raises(PlanError, match="layers"):
        build_plan(local, remote, [1], [2], layers=[7])
    with pytest.raises(PlanError, match="kinds"):
        build_plan(local, remote, [1], [2], kinds=["swa"])


def test_a_layer_subset_of_a_cross_layer_cache_is_refused_with_the_reason():
    from attention.cache import ALL_LAYERS

    cross = RegionTable((RegionEntry(ALL_LAYERS, "kv", 1 << 20, 500, 8, "DRAM", 0),))
    with pytest.raises(PlanError, match=r"no region for layers \[3\]: a cross_layer cache .*\(layers=None\)"):
        build_plan(cross, cross, [1], [2], layers=[3])
    assert build_plan(cross, cross, [1], [2]).num_descriptors == 1  # every layer: the one region


@pytest.mark.parametrize(
    "lp, rp, match",
    [([0, 1], [0], "2 local pages but 1"), ([8], [0], "local page 8 out of range"), ([0], [12], "remote page 12"),
     ([0, 0], [1, 2], "duplicates"), ([0, 1], [3, 3], "duplicates"), ([-1], [0], "negative")],
)
def test_plan_rejects_bad_pages(lp, rp, match):
    with pytest.raises(PlanError, match=match):
        build_plan(table(1 << 20, 8), table(1 << 30, 12), lp, rp)


def test_plan_rejects_geometry_mismatch():
    with pytest.raises(PlanError, match="bytes per page"):
        build_plan(table(1 << 20, 8), table(1 << 30, 8, kinds=(("mla", 100), ("index", 44))), [0], [0])
    with pytest.raises(PlanError, match="peer has no region"):
        build_plan(table(1 << 20, 8, layers=3), table(1 << 30, 8), [0], [0])


# -- flat page index and index plans (the prepared-list path) -------------------------


def expand_index(plan, local, remote):
    """An index plan's (src, dst, len) rows, through the flat page index of each table."""
    src, dst = local.page_rows()[plan.local_idx], remote.page_rows()[plan.remote_idx]
    assert (src[:, 1] == dst[:, 1]).all()
    return [(int(s), int(d), int(n)) for (s, n, _), (d, _, _) in zip(src, dst)]


def test_flat_page_index_of_a_table():
    t = table(1 << 20, 8, layers=2)
    assert t.total_pages == 4 * 8
    assert [t.first_index(*k) for k in t.keys()] == [0, 8, 16, 24]
    rows = t.page_rows()
    for e in t:
        for p in (0, 5, 7):
            assert tuple(int(x) for x in rows[t.first_index(e.layer, e.kind) + p]) == (e.page_addr(p), e.bytes_per_page, 0)
    strided = t.strided_rows()
    assert strided.shape == (4, 5) and strided.dtype == np.uint64
    assert [tuple(int(x) for x in r) for r in strided] == [(e.base_addr, e.bytes_per_page, 0, e.bytes_per_page, 8) for e in t]
    assert RegionTable.from_wire(t.to_wire()).first_index(1, "index") == 24


def test_index_plan_addresses_exactly_the_paired_pages():
    rng = np.random.default_rng(1)
    local = table(1 << 20, 64, layers=3)
    # The peer lists its regions in another order and has a bigger pool: indices go through each side's table.
    remote = RegionTable(tuple(reversed(table(1 << 32, 96, layers=3).entries)))
    sel = RegionSelection.of(local, remote)
    assert sel.bytes_per_position == 3 * 140
    for _ in range(20):
        n = int(rng.integers(1, 40))
        lp = rng.choice(64, n, replace=False)
        rp = np.sort(rng.choice(96, n, replace=False)) if rng.random() < 0.5 else rng.choice(96, n, replace=False)
        for merge in (True, False):
            plan = index_plan(sel, lp, rp, merge=merge)
            assert plan.local_idx.dtype == np.int32 and plan.local_idx.flags.c_contiguous
            assert expand_index(plan, local, remote) == reference_rows(local, remote, lp.tolist(), rp.tolist())
            ref = build_plan(local, remote, lp, rp, merge=merge)
            # NIXL merges index runs consecutive on both sides within a region: what build_plan merges here.
            assert (plan.num_pages, plan.nbytes, plan.num_descriptors) == (ref.num_pages, ref.nbytes, ref.num_descriptors)
            assert plan.merged is merge and plan.remote is remote


def test_index_plan_descriptor_count_and_selection():
    local, remote = table(1 << 20, 32), table(1 << 30, 48)
    sel = RegionSelection.of(local, remote)
    lp, rp = [0, 1, 2, 3, 10, 11, 20, 21], [5, 6, 7, 9, 12, 13, 40, 30]
    assert index_plan(sel, lp, rp).num_descriptors == 4 * 5
    assert index_plan(sel, lp, rp, merge=False).num_descriptors == 4 * 8
    # A repeated pair (the warm-up) is never consecutive: one descriptor each.
    assert index_plan(sel, [3] * 6, [7] * 6).num_descriptors == 4 * 6
    sub = RegionSelection.of(local, remote, layers=[1], kinds=["index"])
    plan = index_plan(sub, [1], [2])
    assert plan.num_descriptors == 1 and plan.nbytes == 40
    assert expand_index(plan, local, remote) == [(local.get(1, "index").page_addr(1), remote.get(1, "index").page_addr(2), 40)]
    with pytest.raises(PlanError, match="layers"):
        RegionSelection.of(local, remote, layers=[7])
    with pytest.raises(PlanError, match="peer has no region"):
        RegionSelection.of(table(1 << 20, 8, layers=3), table(1 << 30, 8))
    with pytest.raises(PlanError, match="bytes per page"):
        RegionSelection.of(table(1 << 20, 8), table(1 << 30, 8, kinds=(("mla", 100), ("index", 44))))


def test_finished_pages():
    assert [finished_pages(t, 200) for t in (0, 63, 64, 128, 199, 200)] == [0, 0, 1, 2, 3, 4]
    assert finished_pages(128, 128) == 2 and finished_pages(1, 1) == 1
    with pytest.raises(ValueError):
        finished_pages(201, 200)


# -- compatibility --------------------------------------------------------------


BASE = CompatInfo("deepseek-ai/DeepSeek-V3.2", 62, 64, "fp8_656", "fp8_132", True)


@pytest.mark.parametrize(
    "field, value",
    [("model", "zai-org/GLM-5"), ("num_layers", 61), ("page_size", 256), ("kv_format", "bf16_576"),
     ("index_format", "bf16_128"), ("has_mtp", False), ("state_formats", (("swa", "v4_584"),))],
)
def test_compat_mismatch_names_field(field, value):
    import dataclasses

    other = dataclasses.replace(BASE, **{field: value})
    assert other.digest() != BASE.digest()
    assert [d.field for d in diff_compat(BASE, other)] == [field]
    t = table(0, 4)
    with pytest.raises(CompatibilityError) as err:
        check_compatible("peer@1", BASE, other, other.digest(), t, t)
    assert err.value.fields == (field,)
    assert f"{field}: local=" in str(err.value) and "peer@1" in str(err.value)


def test_compat_hash_and_regions():
    assert CompatInfo.from_wire(BASE.to_wire()) == BASE
    assert BASE.digest() == CompatInfo.from_wire(BASE.to_wire()).digest()
    t = table(0, 4)
    check_compatible("p", BASE, BASE, BASE.digest(), t, table(1 << 30, 9))  # pool sizes may differ
    with pytest.raises(CompatibilityError) as err:
        check_compatible("p", BASE, BASE, "0" * 64, t, t)
    assert err.value.fields == ("compat_hash",)
    with pytest.raises(CompatibilityError) as err:
        check_compatible("p", BASE, BASE, BASE.digest(), t, table(0, 4, kinds=(("mla", 100), ("index", 44))))
    assert err.value.fields == ("regions[layer=0,kind=index].bytes_per_page", "regions[layer=1,kind=index].bytes_per_page")
    with pytest.raises(CompatibilityError) as err:
        check_compatible("p", BASE, BASE, BASE.digest(), t, table(0, 4, layers=1))
    assert err.value.fields == ("regions[layer=1,kind=index]", "regions[layer=1,kind=mla]")


# -- notification codec ----------------------------------------------------------


def test_messages_roundtrip_and_foreign():
    for m in (messages.ChunkDone("r|1", 0), messages.ChunkDone("r", 3, 4, 17),
              messages.PushAborted("r", "boom"), messages.PushCancelled("r", "gone")):
        assert messages.decode(messages.encode(m)) == m
    assert messages.decode(b"hello") is None
    assert messages.decode(messages.PREFIX + b"{not json") is None
    assert messages.decode(messages.PREFIX + b'{"t":"?","r":"x"}') is None


def test_page_runs_are_maximal_and_expand_to_the_pairing():
    from transfer import PageRuns

    rng = np.random.default_rng(1)
    for _ in range(50):
        n = int(rng.integers(0, 30))
        lp = np.concatenate([np.arange(s, s + k) for s, k in zip(rng.choice(1000, 5, replace=False) * 10,
                                                                 rng.integers(1, 8, 5))])[:n]
        rp = rng.permutation(200)[:lp.size] if rng.random() < 0.3 else np.arange(lp.size) + 7
        runs = PageRuns.of(lp, rp)
        got_l = np.concatenate([np.arange(a, a + k) for a, k in zip(runs.local, runs.length)] or [np.zeros(0)])
        got_r = np.concatenate([np.arange(a, a + k) for a, k in zip(runs.remote, runs.length)] or [np.zeros(0)])
        assert got_l.tolist() == lp.tolist() and got_r.tolist() == rp.tolist() and runs.num_pages == lp.size
        # Maximal: a run never continues the previous one on both sides.
        ends_l, ends_r = runs.local[:-1] + runs.length[:-1], runs.remote[:-1] + runs.length[:-1]
        assert not ((ends_l == runs.local[1:]) & (ends_r == runs.remote[1:])).any()
        assert len(PageRuns.of(lp, rp, merge=False)) == lp.size


def test_page_runs_split_caps_every_run_and_keeps_the_pairing():
    from transfer import PageRuns

    runs = PageRuns.of(np.r_[0:10, 20:23, 40], np.r_[100:113, 5])
    cut = runs.split(4)
    assert cut.local.tolist() == [0, 4, 8, 20, 40] and cut.remote.tolist() == [100, 104, 108, 110, 5]
    assert cut.length.tolist() == [4, 4, 2, 3, 1] and cut.num_pages == runs.num_pages
    assert runs.split(None) is runs and runs.split(10) is runs  # nothing longer than the cap
    rng = np.random.default_rng(2)
    for _ in range(30):
        lp = np.sort(rng.choice(400, int(rng.integers(1, 120)), replace=False))
        rp = lp + 3
        cap = int(rng.integers(1, 20))
        cut = PageRuns.of(lp, rp).split(cap)
        assert int(cut.length.max()) <= cap
        got_l = np.concatenate([np.arange(a, a + k) for a, k in zip(cut.local, cut.length)])
        got_r = np.concatenate([np.arange(a, a + k) for a, k in zip(cut.remote, cut.length)])
        assert got_l.tolist() == lp.tolist() and got_r.tolist() == rp.tolist()
    with pytest.raises(ValueError, match="max_pages"):
        PageRuns.of(np.arange(5), np.arange(5)).split(0)
