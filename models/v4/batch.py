"""What one forward of the paged DeepSeek-V4 model covers: ``V4Batch``.

The V4 runner (``workers.v4_runner``) builds one per forward, and the MTP layer's paged forward
(``models.v4.mtp``) reads its tokens, positions and pages: the engine calls
``model.mtp_forward(runner.build_batch(...), ...)`` as it does for DeepSeek-V3.2, whose batch
(``models.batch.ForwardBatch``) carries cache slots instead of per-group page lists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from models.batch import ForwardMode


@dataclass(frozen=True, eq=False)
class V4Batch:
    """Request ``r``'s ``q_lens[r]`` new tokens at positions ``starts[r] ..``, its pages ``page_tables[r]``
    (group name -> page ids, `workers.page_tables.PageTable.frozen`).

    input_ids: int64 ``[T]`` (``T = sum(q_lens)``, requests in order) on the forward's device."""

    mode: ForwardMode
    q_lens: tuple[int, ...]
    input_ids: torch.Tensor
    starts: tuple[int, ...]
    page_tables: tuple[Mapping[str, Sequence[int]], ...]

    def __post_init__(self) -> None:
        R = len(self.q_lens)
        if not R or len(self.starts) != R or len(self.page_tables) != R or self.input_ids.shape != (sum(self.q_lens),):
            raise ValueError(f"a V4 batch of {R} requests needs one start and page table each and "
                             f"{sum(self.q_lens)} token ids, got {len(self.starts)}, {len(self.page_tables)} "
                             f"and {tuple(self.input_ids.shape)}")
        for table in self.page_tables:
            if not isinstance(table, Mapping):
                raise TypeError("a DeepSeek-V4 work item's page table is its pages per cache group")

    @classmethod
    def of(cls, mode: ForwardMode, token_ids: Sequence[Sequence[int]], starts: Sequence[int],
           page_tables: Sequence[Mapping[str, Sequence[int]]], device) -> "V4Batch":
        """Request ``r``'s new tokens ``token_ids[r]`` (host ints) at positions ``starts[r] ..``."""
        ids = torch.tensor([t for seq in token_ids for t in seq], dtype=torch.int64, device=device)
        return cls(mode, tuple(len(t) for t in token_ids), ids, tuple(int(s) for s in starts), tuple(page_tables))

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    def query_ranges(self) -> list[tuple[int, int]]:
        out, start = [], 0
        for n in self.q_lens:
            out.append((start, start + n))
            start += n
        return out


def sequence_positions(q_lens: Sequence[int], seq_lens: Sequence[int], device
                       ) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """Token ranges of each sequence in a forward over ``q_lens[r]`` new tokens of sequences that hold
    ``seq_lens[r]`` already, and the positions int64 ``[sum(q_lens)]`` of those tokens."""
    ranges, pos = [], []
    start = 0
    for n, s in zip(q_lens, seq_lens):
        ranges.append((start, start + n))
        pos.append(torch.arange(s, s + n, device=device))
        start += n
    positions = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.long, device=device)
    return ranges, positions
