"""Where each routed (token, expert) pair is computed: rows grouped by local expert.

The router gives every token ``t`` its ``top_k`` distinct expert ids
``ids[t, k]``. Pair ``p = t * top_k + k`` is one (token, expert) choice. A
layout lists, for each of this rank's experts ``e`` (local index, expert id
``first_expert + e``), the pairs it computes:

* **contiguous** (prefill, eager): ``pairs [T * top_k]`` int32 is every pair
  sorted by local expert (stable: by pair index within an expert); expert
  ``e``'s pairs are ``pairs[row_start[e] : row_start[e] + counts[e]]``. Pairs
  routed to other ranks' experts sort last, beyond every expert's run.
* **masked** (decode under ``ForwardBatch.static_shapes``): ``pairs
  [E_local, max_m]`` int32, expert ``e``'s pairs in ``pairs[e, :counts[e]]``,
  the rest ``-1``; ``row_start[e] = e * max_m``. This is the index table of
  the fixed-shape ``[E_local, max_m, hidden]`` layout (``permute`` builds that
  tensor; the Triton kernels gather rows through the table instead, so the
  ``E_local * max_m * hidden`` activation tensor is never materialized).
  ``max_m`` is a static bound (default ``T``: an expert gets at most one pair
  per token), so no shape depends on the routing and nothing is read back to
  the host: CUDA graphs capture it.

Both are built by the same few fixed-shape torch ops (a stable sort by expert,
a scatter-add count, a cumulative sum). Expert GEMMs write their output row
of pair ``p`` to row ``p`` of a ``[T * top_k, hidden]`` tensor, so the
un-permute is a fixed-order weighted sum over each token's ``top_k`` rows
(``combine``), deterministic (no atomics): a replayed graph equals the eager
step bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertLayout:
    """Pairs grouped by local expert (see the module doc).

    pairs:        int32 ``[T * top_k]`` (contiguous) or ``[E_local, max_m]`` (masked, ``-1`` = empty)
    row_start:    int32 ``[E_local]`` first entry of expert ``e`` in ``pairs.flatten()``
    counts:       int32 ``[E_local]`` pairs of expert ``e``
    ids:          int64 ``[T, top_k]`` the router's global expert ids
    first_expert: global id of local expert 0
    n_experts:    routed experts of the model (all ranks)
    max_m:        rows per expert of the masked layout; ``None`` for the contiguous layout
    """

    pairs: torch.Tensor
    row_start: torch.Tensor
    counts: torch.Tensor
    ids: torch.Tensor
    first_expert: int
    n_experts: int
    max_m: int | None = None

    @property
    def masked(self) -> bool:
        return self.max_m is not None

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[1])

    @property
    def num_pairs(self) -> int:
        return int(self.ids.numel())

    @property
    def num_local(self) -> int:
        return int(self.counts.shape[0])

    @property
    def all_local(self) -> bool:
        """Every expert is this rank's (no expert parallelism): every pair is computed here."""
        return self.num_local == self.n_experts

    @property
    def expected_m(self) -> int:
        """Pairs per expert under balanced routing (sizes kernel tiles; a hint, not a bound)."""
        return -(-self.num_pairs // max(self.n_experts, 1))

    def local_pairs(self) -> torch.Tensor:
        """bool ``[T, top_k]``: the pairs routed to this rank's experts."""
        local = self.ids - self.first_expert
        return (local >= 0) & (local < self.num_local)


def _sort_pairs(ids: torch.Tensor, first_expert: int, num_local: int):
    """(local expert of each sorted pair (``num_local`` = another rank's), pair order,
    counts ``[num_local + 1]``, starts ``[num_local + 1]``), all int64, fixed shapes."""
    local = ids.reshape(-1) - first_expert
    key = torch.where((local >= 0) & (local < num_local), local, num_local)
    sorted_key, order = torch.sort(key, stable=True)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    starts = torch.cumsum(counts, 0) - counts
    return sorted_key, order, counts, starts


def contiguous_layout(ids: torch.Tensor, first_expert: int, num_local: int, n_experts: int) -> ExpertLayout:
    """Pairs sorted by local expert (prefill / eager)."""
    _, order, counts, starts = _sort_pairs(ids, first_expert, num_local)
    return ExpertLayout(order.to(torch.int32), starts[:num_local].to(torch.int32), counts[:num_local].to(torch.int32),
                        ids, first_expert, n_experts)


def masked_layout(ids: torch.Tensor, first_expert: int, num_local: int, n_experts: int,
                  max_m: int | None = None) -> ExpertLayout:
    """Fixed-shape ``[num_local, max_m]`` pair table (CUDA-graph capturable decode).

    ``max_m`` defaults to the token count ``T``, the most pairs one expert can
    get (a token's ids are distinct); a smaller bound could drop pairs and is refused."""
    T = ids.shape[0]
    max_m = T if max_m is None else max_m
    if max_m < T:
        raise ValueError(f"masked layout: max_m={max_m} < {T} tokens could drop routed pairs")
    sorted_key, order, counts, starts = _sort_pairs(ids, first_expert, num_local)
    rank = torch.arange(order.numel(), device=ids.device) - starts[sorted_key]
    scratch = num_local * max_m  # other ranks' pairs land in one scratch entry, cut off below
    dest = torch.where(sorted_key < num_local, sorted_key * max_m + rank, scratch)
    table = torch.full((scratch + 1,), -1, dtype=torch.int32, device=ids.device)
    table.scatter_(0, dest, order.to(torch.int32))
    row_start = torch.arange(num_local, dtype=torch.int32, device=ids.device) * max_m
    return ExpertLayout(table[:scratch].view(num_local, max_m), row_start, counts[:num_local].to(torch.int32),
                        ids, first_expert, n_experts, max_m)


def permute(x: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """The masked layout's activations ``[E_local, max_m, hidden]`` (empty rows zero),
    or the contiguous layout's ``[T * top_k, hidden]`` (rows of other ranks' pairs zero):
    row ``r`` holds the token of pair ``pairs.flatten()[r]``. For kernels that take
    materialized grouped activations (DeepGEMM's masked and contiguous GEMMs)."""
    flat = layout.pairs.reshape(-1).long()
    rows = torch.arange(flat.numel(), device=flat.device)
    end = (layout.row_start.long() + layout.counts.long())
    if layout.masked:
        valid = flat >= 0
    else:  # a row is valid if it lies inside its expert's run: before the end of the last run
        valid = rows < end[-1] if layout.num_local else torch.zeros_like(rows, dtype=torch.bool)
    tok = torch.where(valid, flat, 0) // layout.top_k
    out = x[tok] * valid[:, None].to(x.dtype)
    return out.view(*layout.pairs.shape, x.shape[-1])
