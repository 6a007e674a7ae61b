"""What the sampler and the acceptance rule return (device tensors), and the step's one read-back.

Each output packs into one fp32 ``[R, C]`` tensor (token ids are exact in
fp32 below 2**24; every vocabulary here is far smaller), `read_back` copies
any number of packed tensors to the host in one transfer, and ``unpack``
turns a row back into `TokenSample` s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_PACKED_ID = 1 << 24
"""Token ids travel as fp32 in a packed read-back: exact below this."""


@dataclass
class TokenSample:
    """One chosen token on the host: its id, log-probability and, if asked, the top ones."""

    token: int
    logprob: float
    top_logprobs: dict[int, float] | None = None


def _top(values: list[float], n_top: int, want: int) -> dict[int, float] | None:
    """``{id: logprob}`` of the first ``want`` of ``n_top`` (ids, then logprobs) packed values."""
    if not want:
        return None
    return {int(values[j]): values[n_top + j] for j in range(want)}


@dataclass
class SampleOutput:
    """One token per row (all on the logits' device).

    tokens: int64 ``[R]``; logprobs: fp32 ``[R]`` of the chosen tokens (None
    when not asked); top_ids: int64 ``[R, n]`` / top_logprobs: fp32 ``[R, n]``
    the ``n`` most likely tokens (None when no row asked); probs: fp32
    ``[S, V]`` the drawing rows' distributions (only when asked).
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    probs: torch.Tensor | None = None

    def packed(self) -> torch.Tensor:
        """fp32 ``[R, 2 + 2n]``: token, logprob, then n top ids and n top logprobs."""
        if self.logprobs is None:
            raise ValueError("packing needs the logprobs: sample with want_logprobs=True")
        cols = [self.tokens.float()[:, None], self.logprobs[:, None]]
        if self.top_ids is not None:
            cols += [self.top_ids.float(), self.top_logprobs]
        return torch.cat(cols, dim=1)

    @staticmethod
    def unpack(rows: list[list[float]], top_logprobs: tuple[int, ...]) -> list[TokenSample]:
        """Host rows of `packed` -> one `TokenSample` per row; ``top_logprobs[r]``: how many row r wants."""
        out = []
        for vals, want in zip(rows, top_logprobs):
            n_top = (len(vals) - 2) // 2
            out.append(TokenSample(int(vals[0]), vals[1], _top(vals[2:], n_top, want)))
        return out


@dataclass
class AcceptOutput:
    """The outcome of verifying ``k`` drafts per row (all on the target logits' device).

    num_accepted: int64 ``[R]`` drafts accepted (0..k); tokens: int64
    ``[R, k + 1]`` the accepted drafts then the correction / bonus token, -1
    after it; logprobs: fp32 ``[R, k + 1]`` of those tokens (0 after);
    top_ids / top_logprobs: ``[R, k + 1, n]`` or None.
    """

    num_accepted: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None

    def packed(self) -> torch.Tensor:
        """fp32 ``[R, 1 + (k + 1) * (2 + 2n)]``: accepted count, then per position
        token, logprob, n top ids, n top logprobs."""
        per_pos = [self.tokens.float()[..., None], self.logprobs[..., None]]
        if self.top_ids is not None:
            per_pos += [self.top_ids.float(), self.top_logprobs]
        r = self.tokens.shape[0]
        return torch.cat([self.num_accepted.float()[:, None], torch.cat(per_pos, dim=2).reshape(r, -1)], dim=1)

    @staticmethod
    def unpack(rows: list[list[float]], width: int, top_logprobs: tuple[int, ...]) -> list[list[TokenSample]]:
        """Host rows of `packed` (``width`` = k + 1 positions) -> each row's emitted tokens
        (accepted drafts + one), as `TokenSample` s."""
        out = []
        for vals, want in zip(rows, top_logprobs):
            per = (len(vals) - 1) // width
            n_top = (per - 2) // 2
            row = []
            for j in range(int(vals[0]) + 1):
                v = vals[1 + j * per: 1 + (j + 1) * per]
                row.append(TokenSample(int(v[0]), v[1], _top(v[2:], n_top, want)))
            out.append(row)
        return out


def read_back(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors on the host, in one device-to-host copy (one sync).

    Each tensor is flattened, converted to fp32 and concatenated on the
    device, then split on the host back to its shape (as fp32).
    """
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1).float() for t in tensors]).cpu()
    out, at = [], 0
    for t in tensors:
        out.append(flat[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out
