"""The page-level prefix cache of one page pool: which full pages hold which prompt prefix.

A page id addresses 64 tokens in every cache of every layer (MLA latent,
indexer keys, the MTP layer's pages: `workers.page_pool`), so caching a page
id brings all of them back together: a suffix token's indexer top-k over the
whole context is what it would be without the cache.

Keys. Page ``i`` of a token sequence is keyed by a hash chain,
``key_i = digest(key_{i-1}, tokens[64 i : 64 (i + 1) + lookahead])`` with
``key_{-1} = salt``: it covers every token up to the end of the page, and,
where the replica writes the MTP layer's pages, one more (`LOOKAHEAD`,
`key_lookahead`): the MTP layer's entry of a page's last position is
computed from the *next* token, so a page's bytes depend on it. The salt
(`cache_salt`) covers the rest of what changes the cached bytes: the
checkpoint config, dtype, cache format, indexer rotation, backend and whether
the MTP layer's pages are written. The default digest is SHA-256; on top of
that a hit compares every entry in full (its tokens, and that its parent is
the entry matched for the page before), so even a forced hash collision
(a test injects ``digest``) can only miss, never serve another prefix's pages.

Life of a cached page (the pool keeps the reference counts): a request's
full, written pages are `insert` ed when it releases them; while any request
references a cached page it is shared read-only; once none does it is
"parked" in a least-recently-used order, still matchable and counted as
free by the pool, until the pool needs a page and `evict` s the least
recently used one (a request's tail pages before its head: `park` takes them
in reverse). This module holds no page memory and knows nothing of requests.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from attention.formats import PAGE_SIZE
from models.config import config_identity

if TYPE_CHECKING:
    from workers.rank_build import RankSpec

LOOKAHEAD = 1
"""Tokens after a page that its key covers where the replica writes the MTP layer's pages (the MTP layer's
entry of the page's last position reads the next token). Without them (`key_lookahead`) a page's bytes
depend on its own tokens and those before only, and its key covers nothing after it."""


def key_lookahead(mtp: bool) -> int:
    """The tokens after a page its key covers: `LOOKAHEAD` when the replica writes the MTP layer's pages
    (``mtp``: as `replica_salt` takes it), else 0."""
    return LOOKAHEAD if mtp else 0

HOST_BYTES_PER_CACHED_PAGE = 1100
"""Host memory of one cached page's entry (its key, its 65 token ids, the index): measured with tracemalloc
at 1,046 B (CPython 3.11). The pages themselves are the pool's: caching allocates no cache memory."""

Digest = Callable[[bytes, bytes], bytes]
"""``digest(parent_key, page_token_bytes) -> key``."""


def sha256_digest(parent: bytes, tokens: bytes) -> bytes:
    return hashlib.sha256(parent + tokens).digest()


def cache_salt(*parts: object) -> bytes:
    """The chain's root key from what else changes a page's bytes (strings of the replica's build)."""
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()


def replica_salt(spec: "RankSpec", mtp: bool) -> bytes:
    """The prefix cache's chain root (`workers.prefix_cache.cache_salt`) of a replica built from ``spec``:
    everything besides the tokens that changes its pages' bytes (the checkpoint config, dtype, cache format,
    indexer rotation, backend, page layout, and ``mtp``: whether the MTP layer's pages are written). The
    routers hash prompts with it too, so replicas of one role share their keys."""
    from models.registry import read_config_json  # a clear ConfigError for a missing checkpoint

    raw = read_config_json(spec.model_dir)
    return cache_salt(config_identity(raw), spec.dtype, spec.kv_cache_dtype, spec.use_hadamard, spec.backend,
                      spec.page_layout, bool(mtp and spec.with_mtp))


def page_token_bytes(token_ids: Sequence[int], i: int, lookahead: int = LOOKAHEAD) -> bytes | None:
    """Page ``i``'s tokens and the ``lookahead`` after it as int64 bytes; None when ``token_ids`` is too short
    for them."""
    lo, hi = i * PAGE_SIZE, (i + 1) * PAGE_SIZE + lookahead
    if len(token_ids) < hi:
        return None
    return array("q", token_ids[lo:hi]).tobytes()


def cacheable_pages(num_tokens: int, lookahead: int = LOOKAHEAD) -> int:
    """Full pages a sequence of ``num_tokens`` known tokens can key (each needs its ``lookahead`` tokens)."""
    return max(0, (num_tokens - lookahead) // PAGE_SIZE)


def chain_keys(token_ids: Sequence[int], salt: bytes, max_pages: int | None = None,
               digest: Digest = sha256_digest, lookahead: int = LOOKAHEAD) -> list[bytes]:
    """The keys of ``token_ids``' leading full pages (at most ``max_pages``)."""
    n = cacheable_pages(len(token_ids), lookahead)
    if max_pages is not None:
        n = min(n, max_pages)
    keys, parent = [], salt
    for i in range(n):
        parent = digest(parent, page_token_bytes(token_ids, i, lookahead))
        keys.append(parent)
    return keys


def held_keys(cache: "PrefixCache", holder, token_ids: Sequence[int]) -> list[bytes]:
    """``cache.keys(token_ids)``, kept on ``holder`` (a request or a prefill task: its ``prefix_keys`` field,
    ``(len(token_ids), keys)``) and computed again only when the length changes (a request re-admitted with
    its output after preemption). The one memo of every caller of `waits_for_computing`."""
    n = len(token_ids)
    if holder.prefix_keys is None or holder.prefix_keys[0] != n:
        holder.prefix_keys = (n, cache.keys(token_ids))
    return holder.prefix_keys[1]


def waits_for_computing(cache: "PrefixCache", token_ids: Sequence[int], keys: Sequence[bytes],
                        computing: set[bytes]) -> bool:
    """Whether a prompt of ``token_ids`` (its page ``keys``: `PrefixCache.keys`) should wait before taking
    pages: prompts being computed right now (their page keys: ``computing``) will cache more of its reusable
    leading pages (those before its last token, which is always computed) than ``cache`` holds now. The one
    rule of the engine's scheduler and the PD prefill worker; the wait ends when those pages are cached (pages
    are cached as soon as they are written: `workers.page_pool.PagePool.publish`) or their prompt goes away."""
    usable = (len(token_ids) - 1) // PAGE_SIZE
    shared = 0
    for key in keys[:usable]:
        if key not in computing:
            break
        shared += 1
    return shared > 0 and len(cache.match(token_ids, shared)) < shared


def routing_key(key: bytes) -> int:
    """A key's first 8 bytes as an unsigned int: what replicas report and routers compare (a
    collision there only misjudges an overlap; the cache itself compares in full)."""
    return int.from_bytes(key[:8], "big")


def continues(entry, parent, tokens: bytes) -> bool:
    """Whether the entry found under a chain key is ``parent``'s continuation by ``tokens``: keys are
    compared in full, so a key equal by collision (another prefix's entry) is not a match. One rule for
    both caches (this one and ``workers.v4_prefix``), their lookups and their inserts."""
    return entry.parent is parent and entry.tokens == tokens


@dataclass(eq=False)
class _Entry:
    key: bytes
    page: int
    parent: "_Entry | None"
    tokens: bytes
    children: set["_Entry"] = field(default_factory=set)


@dataclass
class CacheCounters:
    """Cumulative counts since start. ``queries`` / ``hits``: prompt tokens looked up by admitted requests /
    of them found cached; ``evictions``: cached pages reclaimed for other use; ``inserted``: pages cached."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0
    inserted: int = 0


@dataclass
class PrefixCache:
    """Cached full pages by key (module doc). ``salt``: `cache_salt` of the replica; ``digest``: the chain's
    hash (tests inject a colliding one); ``lookahead``: tokens after a page its key covers (`key_lookahead`)."""

    salt: bytes
    digest: Digest = sha256_digest
    lookahead: int = LOOKAHEAD
    counters: CacheCounters = field(default_factory=CacheCounters)
    _by_key: dict[bytes, _Entry] = field(default_factory=dict)
    _by_page: dict[int, _Entry] = field(default_factory=dict)
    _parked: OrderedDict[int, None] = field(default_factory=OrderedDict)
    """Unreferenced cached pages, least recently used first."""

    # ------------------------------------------------------------- lookups
    def match(self, token_ids: Sequence[int], max_pages: int) -> list[int]:
        """Page ids of the longest cached prefix of ``token_ids``, at most ``max_pages`` pages. No side effect."""
        pages: list[int] = []
        parent: _Entry | None = None
        key = self.salt
        for i in range(min(max_pages, cacheable_pages(len(token_ids), self.lookahead))):
            toks = page_token_bytes(token_ids, i, self.lookahead)
            key = self.digest(key, toks)
            e = self._by_key.get(key)
            if e is None or not continues(e, parent, toks):
                break
            pages.append(e.page)
            parent = e
        return pages

    def keys(self, token_ids: Sequence[int]) -> list[bytes]:
        """The chain keys of ``token_ids``' full pages under this cache's salt, digest and lookahead."""
        return chain_keys(token_ids, self.salt, None, self.digest, self.lookahead)

    def holds(self, page: int) -> bool:
        return page in self._by_page

    def __len__(self) -> int:
        """Pages cached (referenced or parked)."""
        return len(self._by_page)

    @property
    def parked_count(self) -> int:
        """Cached pages no request references: reclaimable."""
        return len(self._parked)

    def is_parked(self, page: int) -> bool:
        return page in self._parked

    def routing_keys(self, limit: int) -> list[int]:
        """`routing_key` of up to ``limit`` cached pages: referenced ones first, then parked ones from the
        most recently used (the ones least likely to be evicted before a routed request arrives)."""
        hot = [e.key for p, e in self._by_page.items() if p not in self._parked]
        cold = [self._by_page[p].key for p in reversed(self._parked)]
        return [routing_key(k) for k in (hot + cold)[:limit]]

    # ------------------------------------------------------------- changes
    def insert(self, token_ids: Sequence[int], pages: Sequence[int], num_pages: int) -> int:
        """Cache the first ``num_pages`` of ``pages`` (a request's, in order) as holding ``token_ids``' prefix;
        the caller vouches that their bytes are written. Pages already cached under their key are kept; a page
        whose prefix another page already caches stays uncached (the chain continues through that one); a key
        taken by a different prefix (a collision) ends the insert. Returns the pages newly cached."""
        n = min(num_pages, len(pages), cacheable_pages(len(token_ids), self.lookahead))
        parent: _Entry | None = None
        key, added = self.salt, 0
        for i in range(n):
            toks = page_token_bytes(token_ids, i, self.lookahead)
            key = self.digest(key, toks)
            e = self._by_key.get(key)
            if e is not None:
                if not continues(e, parent, toks):
                    break  # a collision: this chain cannot be cached past here
                parent = e
                continue
            page = pages[i]
            if page in self._by_page:
                break  # cached under another key: not this request's bytes to vouch for
            e = _Entry(key, page, parent, toks)
            if parent is not None:
                parent.children.add(e)
            self._by_key[key] = self._by_page[page] = parent = e
            added += 1
        self.counters.inserted += added
        return added

    def park(self, pages: Sequence[int]) -> None:
        """``pages`` (cached) lost their last reference; the last of them is the first to go."""
        for p in reversed(pages):
            self._parked[p] = None

    def unpark(self, page: int) -> None:
        """A parked page is referenced again."""
        del self._parked[page]

    def evict(self) -> list[int]:
        """Forget the least recently used parked page and the cached pages that continue its prefix (no
        lookup could reach them any more; they are parked too, since a request referencing a page references
        every page before it). Returns their ids, now the pool's to reuse."""
        page, _ = self._parked.popitem(last=False)
        root = self._by_page[page]
        if root.parent is not None:
            root.parent.children.discard(root)
        out, stack = [], [root]
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            del self._by_page[e.page], self._by_key[e.key]
            if e.page in self._parked or e is root:
                self._parked.pop(e.page, None)
                out.append(e.page)
            # else (never expected): a referenced page is only un-indexed; its holder frees it as uncached.
        self.counters.evictions += len(out)
        return out

    def clear(self) -> None:
        """Forget every entry (a replica that restarts its pool reports an empty cache)."""
        self._by_key.clear()
        self._by_page.clear()
        self._parked.clear()
