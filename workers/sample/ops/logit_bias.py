"""Sparse additive logit biases: OpenAI's ``logit_bias`` and the ``min_tokens`` block.

Both are a few (row, token, value) entries on a batch's logits, so they are
applied as one ``index_put_`` of those entries, never as a dense ``[R, V]``
bias. A ``min_tokens`` block is a ``-inf`` entry: no bias can undo it.
Entries carry ``until``, the number of a row's leading positions they hold
for: a verify step scores ``k + 1`` positions of a row, and a stop token
blocked for the next 2 tokens must be blocked at positions 0 and 1 only
(then MTP picks exactly the tokens decoding one at a time would).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

UNTIL_ALWAYS = 1 << 30
"""``until`` of an entry that holds at every position (``logit_bias``)."""


@dataclass
class LogitBias:
    """Entries ``(rows[i], cols[i]) += values[i]`` at a row's positions ``< until[i]``.

    rows, cols, until: int64 ``[N]``; values: fp32 ``[N]`` (``-inf`` blocks), on the logits' device.
    """

    rows: torch.Tensor
    cols: torch.Tensor
    values: torch.Tensor
    until: torch.Tensor

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Biased fp32 logits (a new tensor): ``[R, V]`` (position 0 of each row) or
        ``[R, W, V]`` (positions 0..W-1 of each row).

        Entries past their ``until`` add 0 instead of being filtered out: a boolean-mask
        selection has a data-dependent size and so reads the mask back, which stalls the host
        on the decode step in flight (`workers.host_copy`)."""
        if logits.dim() == 2:
            values = torch.where(self.until > 0, self.values, 0.0)
            return logits.index_put((self.rows, self.cols), values, accumulate=True)
        r, w, v = logits.shape
        pos = torch.arange(w, device=logits.device)
        keep = self.until[:, None] > pos[None, :]  # [N, W]
        rows = self.rows[:, None] * w + pos[None, :]
        cols = self.cols[:, None].expand(-1, w)
        values = torch.where(keep, self.values[:, None], 0.0)
        flat = logits.reshape(r * w, v).index_put((rows.reshape(-1), cols.reshape(-1)), values.reshape(-1),
                                                  accumulate=True)
        return flat.view(r, w, v)
