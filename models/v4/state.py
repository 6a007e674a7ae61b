"""Per-sequence attention state of DeepSeek-V4, as plain tensors (the reference form).

What one sequence carries between forwards, per layer:

* ``swa``: the keys (= values) of the uncompressed sliding-window cache,
  ``[k, head_dim]``, rotated at their positions: before a forward the last
  ``sliding_window - 1`` (at most: what attention reads), after it those and
  every key the forward made (so the paged store writes every position's key:
  a cached prefix's pages hold the window before any cut);
* for CSA / HCA layers, a ``CompressorState`` of the attention compressor and,
  for CSA layers, one of the indexer's compressor:

  - ``entries`` ``[n, d]``: every compressed entry emitted so far (entry ``e``
    summarises tokens ``[e * m, (e + 1) * m)``, normed, rotated at ``e * m``);
  - ``pending_kv`` / ``pending_gate`` ``[j < m, w]``: projections of the tokens
    after the last complete window (the partially filled block), raw;
  - ``overlap_kv`` / ``overlap_gate`` ``[m, d]`` (CSA only): the first half
    ("Ca") of the last complete window, gate with its position bias added;
    entry ``e`` mixes it with window ``e + 1``'s second half;
  - ``fed_kv`` / ``fed_gate`` ``[j, w]``: the raw projections of every token fed
    since the state was built from pages, when it was (None for a standalone
    state: nothing records them); the paged store writes them back, and the
    cut states of prefix caching from them (``models.v4.paged_state``).

The paged engine keeps the same information in cache groups (see
``models.v4.cache_spec``): ``swa`` in sliding-window pages, ``entries`` in the
compressed caches, ``pending`` / ``overlap`` in per-sequence state pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CompressorState:
    entries: torch.Tensor
    pending_kv: torch.Tensor
    pending_gate: torch.Tensor
    overlap_kv: torch.Tensor | None = None
    overlap_gate: torch.Tensor | None = None
    fed_kv: torch.Tensor | None = None
    fed_gate: torch.Tensor | None = None

    @classmethod
    def empty(cls, entry_dim: int, proj_dim: int, dtype: torch.dtype, device) -> "CompressorState":
        return cls(torch.zeros(0, entry_dim, dtype=dtype, device=device),
                   torch.zeros(0, proj_dim, dtype=dtype, device=device),
                   torch.zeros(0, proj_dim, dtype=dtype, device=device))

    @property
    def num_entries(self) -> int:
        return int(self.entries.shape[0])


@dataclass
class LayerState:
    swa: torch.Tensor
    comp: CompressorState | None = None
    index: CompressorState | None = None


@dataclass
class SequenceState:
    """All layers' state of one sequence; ``seq_len`` tokens have been forwarded."""

    layers: list[LayerState] = field(default_factory=list)
    seq_len: int = 0
