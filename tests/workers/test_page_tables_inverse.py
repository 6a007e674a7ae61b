"""`workers.page_tables.group_tokens_for_pages` is the inverse of `group_pages_for_tokens`: the
ingress's admission (`deployments.admission.PoolFit`) and the pools count with the same rule."""

from __future__ import annotations

import pytest

from attention.cache_groups import CacheGroup
from workers.page_tables import group_pages_for_tokens, group_tokens_for_pages


@pytest.mark.parametrize("kind,tpp,ratio", [("swa", 256, 1), ("swa", 8, 1), ("compressed", 256, 4),
                                            ("compressed", 16, 128), ("indexer", 64, 4), ("state", 1, 4)])
def test_most_tokens_for_pages_is_the_inverse_of_the_page_count(kind, tpp, ratio):
    g = CacheGroup(f"g-{kind}", kind, tpp, 4, 4 * tpp, (0,), ratio=ratio, window=8 if kind == "swa" else None)
    for pages in range(0, 7):
        n = group_tokens_for_pages(g, pages)
        if n is None:  # a state group: one page, whatever the length
            assert kind == "state" and pages >= 1 and group_pages_for_tokens(g, 10**9) <= pages
            continue
        assert group_pages_for_tokens(g, n) <= pages, (pages, n)
        assert group_pages_for_tokens(g, n + 1) > pages, (pages, n)
