"""The prefix cache of DeepSeek-V4's cache groups: which cached pages hold which prompt prefix, and
what of them a request reuses. Only what is exact is cached.

What a sequence continued from ``c`` tokens reads (``models.v4.paged_state.load_state``): the
sliding-window keys of positions ``[c - window + 1, c)``, every compressed entry and indexer key
before ``c // m`` (each ratio ``m``), and each compressor's state: the raw projections of the
partially filled block and, for overlapping windows (CSA), the block before it. The first two are
pages like MLA pages (written once, never changed); the state is not: it lives in one page per
sequence that every forward rewrites, and it cannot be rebuilt from the other caches (it is the
projection of each layer's hidden state). So:

* **Cuts.** A prefix is reused only up to a *cut*: a multiple of ``G`` =
  lcm(64, the ``swa`` page, every compress ratio) = 256 tokens on DeepSeek-V4 and the tiny
  checkpoints (`cut_tokens`). At a cut no compressor has a pending row, HCA's state is empty, and
  CSA's is its overlap alone (``m`` rows a compressor).
* **Cut states.** With the cache on, each CSA state group (``models.v4.cache_spec.cut_state_groups``)
  holds one page per cut of the sequence besides the live one (page ``k`` holds the state at token
  ``k G``, `group_pages_for_tokens`); the runner writes it when a forward crosses the cut
  (``paged_state.store_cut_states``), so it moves prefill -> decode with the other pages.
  Cost: 1 + n // G pages of each CSA state group per sequence instead of 1 (at most one more than
  its ``swa`` pages).
* **Entries.** The cache keeps one entry per cut of a prefix: cut ``k`` (``c = k G``) is keyed by the
  hash chain of ``workers.prefix_cache`` (64-token pages, each key covering its page and the next
  token, salted by `workers.prefix_cache.replica_salt`), at its last 64-token page; a hit compares
  the cut's tokens and parent in full. The entry holds, per group, the pages of the positions between
  the previous cut and its own (`entry_indices`; a page straddling a cut is held by both entries) and
  its cut state pages. The chain of entries up to ``k`` thus holds every page a sequence of ``c``
  tokens has: sliding-window pages older than the window too, since a page table addresses pages
  by position and keeps them (``workers.page_tables``).
* **A hit** at cut ``c`` gives a request (`hit_pages`): shared, read-only, the pages wholly before
  ``c`` in every group and the cut states of cuts ``<= c``; copied into fresh pages, the page
  straddling ``c`` of each group (a compressed page holds 256 entries = 1,024 / 32,768 tokens: the
  request writes its own entries into it) and the cut state at ``c`` (into the live state page);
  fresh, the rest. Nothing shared is ever written: the request writes positions from ``c`` on only.
* **Validity.** A finished request's cuts ``c <= valid`` tokens are inserted (``valid``: positions
  whose bytes are final, `workers.scheduler.cacheable_tokens`); every sliding-window key is written
  (``models.v4.attention``: a forward keeps all its keys), so each cut's window is in its pages.

Not cached, and why:

* prefix lengths between cuts (up to ``G - 1`` tokens of a prefix are computed again): a cut
  between HCA block boundaries would need the pending raw projections (up to 127 rows of
  ``2 x 512`` fp32 per HCA layer) kept per cut;
* sliding-window pages older than a cut's window are not dropped from the cache on their own: a cut
  entry is evicted whole (leaves first), and a hit's page table must list them;
* the state is never rebuilt by recomputing the tokens before a cut (they need the state before
  them: the recursion ends only at the sequence start).

Life of a cached page: the pools keep reference counts (``workers.page_tables.GroupPagePools``); the
cache holds one reference on each page any entry holds; requests hold their own. A page only the
cache references is reclaimable (counted free) and returns to its pool when the entries holding it
are evicted, least recently used first (leaves before their ancestors: a hit touches its path from
the cut back to the root). This module holds no page memory and knows nothing of requests.
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from attention.cache_groups import CacheGroup
from attention.formats import PAGE_SIZE
from workers.prefix_cache import (LOOKAHEAD, CacheCounters, Digest, continues, page_token_bytes, routing_key,
                                  sha256_digest)

GroupPage = tuple[str, int]
"""``(group name, page id)``."""


def cut_tokens(groups: Sequence[CacheGroup]) -> int:
    """``G``: the cut interval of ``groups`` (module docstring): lcm of the 64-token key page, the
    ``swa`` page and every compress ratio."""
    g = PAGE_SIZE
    for grp in groups:
        g = math.lcm(g, grp.ratio)
        if grp.kind == "swa":
            g = math.lcm(g, grp.tokens_per_page)
    return g


def filled(group: CacheGroup, tokens: int) -> int:
    """Positions of a non-state ``group`` that ``tokens`` tokens fill: every token's key (``swa``), the
    complete entries (``compressed`` / ``indexer``)."""
    return tokens if group.kind == "swa" else tokens // group.ratio


def pages_with_cuts(group: CacheGroup, num_tokens: int, cut: int, cut_groups: Sequence[str]) -> int:
    """Pages of ``group`` a sequence of ``num_tokens`` tokens holds with a prefix cache of cut interval
    ``cut``: one more page per cut ``<= num_tokens`` in a cut state group (``cut_groups``), as without a
    cache otherwise (`workers.page_tables.group_pages_for_tokens`)."""
    from workers.page_tables import group_pages_for_tokens  # (it imports this module)

    extra = num_tokens // cut if group.name in cut_groups and num_tokens > 0 else 0
    return group_pages_for_tokens(group, num_tokens) + extra


def tokens_with_cuts(group: CacheGroup, pages: int, cut: int, cut_groups: Sequence[str]) -> int | None:
    """The most tokens a sequence may have while ``pages_with_cuts(group, n, ...) <= pages`` (its inverse;
    None: any length)."""
    from workers.page_tables import group_tokens_for_pages

    n = group_tokens_for_pages(group, pages)
    if group.name not in cut_groups:
        return n
    most = max(pages, 0) * cut - 1 if pages > 0 else 0  # 1 + n // cut <= pages
    return most if n is None else min(n, most)


@dataclass(eq=False)
class _Cut:
    key: bytes
    """Chain key of the cut's last 64-token page."""
    page_keys: tuple[bytes, ...]
    """Chain keys of its 64-token pages since the previous cut (what replicas report to routers)."""
    parent: "_Cut | None"
    tokens: bytes
    """Its tokens since the previous cut and the `LOOKAHEAD` after it, int64 bytes (compared in full)."""
    cut: int
    pages: dict[str, dict[int, int]]
    """Group -> {page index in a sequence's table: page id} this entry holds (`entry_indices`)."""
    children: set["_Cut"] = field(default_factory=set)


@dataclass
class V4PrefixCache:
    """Cut entries of cached prefixes (module docstring).

    groups: the cache's groups; cut_groups: the names of those holding cut states
    (``models.v4.cache_spec.cut_state_groups``); salt: `workers.prefix_cache.replica_salt` of the
    replica; digest: the chain's hash (tests inject a colliding one)."""

    salt: bytes
    groups: Sequence[CacheGroup]
    cut_groups: tuple[str, ...]
    digest: Digest = sha256_digest
    counters: CacheCounters = field(default_factory=CacheCounters)
    _by_key: dict[bytes, _Cut] = field(default_factory=dict)
    _lru: OrderedDict[_Cut, None] = field(default_factory=OrderedDict)
    """Every entry, least recently used first; an entry is never older than its descendants."""
    _holders: dict[GroupPage, int] = field(default_factory=dict)
    """Each held page -> entries holding it."""

    def __post_init__(self) -> None:
        self.by_name = {g.name: g for g in self.groups}
        unknown = set(self.cut_groups) - {g.name for g in self.groups if g.kind == "state"}
        if unknown:
            raise ValueError(f"cut state groups {sorted(unknown)} are not state groups of the cache")
        self.cut = cut_tokens(self.groups)

    # ------------------------------------------------------------------ geometry
    def pages_for_tokens(self, group: CacheGroup, num_tokens: int) -> int:
        """`pages_with_cuts` of this cache's groups."""
        return pages_with_cuts(group, num_tokens, self.cut, self.cut_groups)

    def entry_indices(self, group: CacheGroup, cut: int) -> range:
        """Page indices of ``group`` the entry of cut ``cut`` holds: the pages of the positions since the
        previous cut (non-state groups), its own cut state (index ``cut // G`` of a cut state group)."""
        if group.name in self.cut_groups:
            return range(cut // self.cut, cut // self.cut + 1)
        if group.kind == "state":
            return range(0)
        t = group.tokens_per_page
        return range(filled(group, cut - self.cut) // t, -(-filled(group, cut) // t))

    def shared_indices(self, group: CacheGroup, cut: int) -> range:
        """Page indices of ``group`` a request holding a hit at ``cut`` shares read-only: the pages wholly
        before the cut, the cut states of cuts ``<= cut``."""
        if group.name in self.cut_groups:
            return range(1, cut // self.cut + 1)
        if group.kind == "state":
            return range(0)
        return range(filled(group, cut) // group.tokens_per_page)

    def copied_index(self, group: CacheGroup, cut: int) -> tuple[int, int] | None:
        """``(index the request writes, index of the cached page copied into it)`` for ``group`` at a hit
        at ``cut``: the page straddling the cut (non-state groups; None when the cut ends a page), the
        cut state into the live page (cut state groups); None otherwise."""
        if group.name in self.cut_groups:
            return 0, cut // self.cut
        if group.kind == "state":
            return None
        f = filled(group, cut)
        return (f // group.tokens_per_page,) * 2 if f % group.tokens_per_page else None

    # ------------------------------------------------------------------ lookups
    def _walk(self, token_ids: Sequence[int], max_cut: int):
        """``(cut, key, page keys, tokens)`` of ``token_ids``' cuts up to ``max_cut`` (each needs its
        `LOOKAHEAD` token)."""
        key, per = self.salt, self.cut // PAGE_SIZE
        c = self.cut
        while c <= max_cut and c + LOOKAHEAD <= len(token_ids):
            keys = []
            for i in range(c // PAGE_SIZE - per, c // PAGE_SIZE):
                key = self.digest(key, page_token_bytes(token_ids, i))
                keys.append(key)
            yield c, key, tuple(keys), array("q", token_ids[c - self.cut:c + LOOKAHEAD]).tobytes()
            c += self.cut

    def match(self, token_ids: Sequence[int], max_tokens: int) -> _Cut | None:
        """The entry of ``token_ids``' longest cached prefix ending at a cut ``<= max_tokens``, or None;
        marks its path used."""
        parent: _Cut | None = None
        for _, key, _, toks in self._walk(token_ids, max_tokens):
            e = self._by_key.get(key)
            if e is None or not continues(e, parent, toks):
                break
            parent = e
        self._touch(parent)
        return parent

    def hit_pages(self, hit: _Cut) -> tuple[dict[str, dict[int, int]], dict[str, tuple[int, int]]]:
        """What a request reuses of the entry ``hit`` (module docstring): ``(shared, copies)``, ``shared[g]``
        ``{index: page}`` of the pages it shares, ``copies[g] = (index, page)``: the cached page to copy
        into its fresh page at that index."""
        held: dict[str, dict[int, int]] = {g: {} for g in self.by_name}
        e = hit
        while e is not None:  # the deepest entry holding an index has its page for this prefix
            for g, pages in e.pages.items():
                for i, p in pages.items():
                    held[g].setdefault(i, p)
            e = e.parent
        shared, copies = {}, {}
        for name, grp in self.by_name.items():
            shared[name] = {i: held[name][i] for i in self.shared_indices(grp, hit.cut)}
            c = self.copied_index(grp, hit.cut)
            if c is not None:
                copies[name] = (c[0], held[name][c[1]])
        return shared, copies

    def holds(self, group: str, page: int) -> bool:
        return (group, page) in self._holders

    def held(self) -> list[GroupPage]:
        return list(self._holders)

    def __len__(self) -> int:
        """Pages held, over every group."""
        return len(self._holders)

    @property
    def num_cuts(self) -> int:
        return len(self._lru)

    def routing_keys(self, limit: int) -> list[int]:
        """`routing_key` of up to ``limit`` cached 64-token pages, most recently used cuts first (a router
        counting pages past the last cut overestimates a hit by less than one cut)."""
        out: list[int] = []
        for e in reversed(self._lru):
            for k in e.page_keys:
                if len(out) == limit:
                    return out
                out.append(routing_key(k))
        return out

    # ------------------------------------------------------------------ changes
    def insert(self, token_ids: Sequence[int], pages: Mapping[str, Sequence[int]],
               valid_tokens: int) -> list[GroupPage]:
        """Cache the cuts ``<= valid_tokens`` of a request holding ``pages`` (its table, group -> page ids
        by index) for ``token_ids``; the caller vouches that every position below ``valid_tokens`` is
        written, and its cut states. Cuts already cached are kept (the chain goes on through them); a key
        taken by another prefix (a collision) ends the insert. Returns the pages newly held (the caller
        takes the cache's reference on each)."""
        parent: _Cut | None = None
        new: list[GroupPage] = []
        for c, key, keys, toks in self._walk(token_ids, valid_tokens):
            e = self._by_key.get(key)
            if e is not None:
                if not continues(e, parent, toks):
                    break  # a collision: this chain cannot be cached past here
                parent = e
                continue
            held = {}
            for name, grp in self.by_name.items():
                idx = self.entry_indices(grp, c)
                if idx and idx[-1] >= len(pages.get(name, ())):
                    self._touch(parent)
                    return new  # the table is shorter than the cut (never expected): stop here
                held[name] = {i: pages[name][i] for i in idx}
            e = _Cut(key, keys, parent, toks, c, {g: p for g, p in held.items() if p})
            if parent is not None:
                parent.children.add(e)
            self._by_key[key] = e
            self._lru[e] = None
            for g, ps in e.pages.items():
                for p in ps.values():
                    n = self._holders.get((g, p), 0)
                    self._holders[(g, p)] = n + 1
                    if not n:
                        new.append((g, p))
            parent = e
        self.counters.inserted += len(new)
        self._touch(parent)
        return new

    def evict(self) -> list[GroupPage]:
        """Forget the least recently used entry (a leaf) and any entry continuing it. Returns the pages no
        entry holds any more (the caller drops the cache's reference on each)."""
        root = next(iter(self._lru))
        if root.parent is not None:
            root.parent.children.discard(root)
        out, stack = [], [root]
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            del self._by_key[e.key]
            self._lru.pop(e)
            for g, ps in e.pages.items():
                for p in ps.values():
                    n = self._holders.pop((g, p)) - 1
                    if n:
                        self._holders[(g, p)] = n
                    else:
                        out.append((g, p))
        self.counters.evictions += len(out)
        return out

    def clear(self) -> list[GroupPage]:
        """Forget every entry; returns every page held."""
        out = list(self._holders)
        self._by_key.clear()
        self._lru.clear()
        self._holders.clear()
        return out

    def _touch(self, e: _Cut | None) -> None:
        """Mark ``e``'s path used: ``e`` first, the root last (the most recent), so that an entry is never
        older than its descendants and the least recently used entry is a leaf."""
        while e is not None:
            self._lru.move_to_end(e)
            e = e.parent
