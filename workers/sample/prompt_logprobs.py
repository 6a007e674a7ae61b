"""Prompt log-probabilities, computed in the prefill pass (no second forward).

A request that asks for them (``SamplingParams.prompt_logprobs``: the top N
per position, 0 = only the prompt token's own) gets, for every prompt
position ``i >= 1``, ``log p(prompt[i] | prompt[:i])`` and the N most likely
tokens there (position 0 has none: nothing precedes it; OpenAI's ``echo``
reports it as ``null``). The hidden state at position ``p`` predicts token
``p + 1``, so a prefill chunk over positions ``[start, end)`` gives the
values of positions ``start + 1 .. end``, up to the prompt's last position
(the hidden state *of* the last position predicts the first output token,
which the sampler handles).

Memory stays bounded: only the rows of requests that asked go through the
head, ``rows_per_block`` rows at a time (a ``[block, vocab]`` fp32 logits
tensor, never ``[chunk, vocab]``: 8k rows of DeepSeek-V3.2's 129k vocabulary
would be 4 GiB), and only the prompt token's logprob and the top N leave a
block, packed like `SampleOutput.packed` (fp32 ``[M, 2 + 2N]``: token,
logprob, N top ids, N top logprobs). The engine reads them back with the
step's samples in its one read-back; a prefill replica keeps a prompt's
packed rows on the device until the prompt's last chunk and reads them back
with token 1 (`workers.prefill_worker`), so they travel to decode in the
`PrefillResult` and out with the request's first output.

Values are those of the raw logits, as the sampler's (`workers.sample.sampler`):
``logit - logsumexp(logits)``, ties in the top N broken as ``torch.topk``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from workers.host_copy import tensor_on, to_device
from workers.sample.output import SampleOutput

LOGITS_BUDGET = 1 << 24
"""fp32 logits elements one block may hold (64 MiB): rows per block = this // vocab."""


@dataclass
class PromptLogprobs:
    """One request's prompt log-probabilities on the host, filled chunk by chunk.

    num_prompt: the prompt's length n. n_top: top tokens per position (0 =
    the prompt token's own only). ``logprobs[j]`` / ``top[j]``: position
    ``j + 1`` (``top`` stays empty when ``n_top`` is 0). scheduled: hidden
    positions ``p < scheduled`` were sent to the device (a preempted
    request's re-prefill skips them). parts: fp32 ``[m, 2 + 2N]`` packed rows
    still on the device (a prefill replica's, until the prompt's last chunk);
    empty when the result crosses processes.
    """

    num_prompt: int
    n_top: int
    scheduled: int = 0
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)
    parts: list[torch.Tensor] = field(default_factory=list, repr=False)

    @classmethod
    def wanted(cls, params, num_prompt: int) -> "PromptLogprobs | None":
        """An empty record when ``params`` (``SamplingParams``) asks for prompt logprobs, else None."""
        n = getattr(params, "prompt_logprobs", None)
        return None if n is None else cls(num_prompt, n)

    @property
    def complete(self) -> bool:
        return len(self.logprobs) == self.num_prompt - 1

    def take_rows(self, start: int, end: int) -> tuple[int, int]:
        """The hidden positions ``[lo, hi)`` of a chunk over ``[start, end)`` whose values are
        still to compute (``lo == hi``: none); marks them scheduled."""
        if start > self.scheduled:
            # Positions before ``start`` would never be computed (a prefix-cache hit would need
            # its stored logprobs; there is no prefix cache yet).
            raise ValueError(f"prompt logprobs: a chunk starts at {start}, past position {self.scheduled}")
        lo, hi = self.scheduled, min(end, self.num_prompt - 1)
        if hi <= lo:
            return lo, lo
        self.scheduled = hi
        return lo, hi

    def add_rows(self, rows: list[list[float]]) -> None:
        """Append host rows of the packed layout (one per position, in order)."""
        for s in SampleOutput.unpack(rows, (self.n_top,) * len(rows)):
            self.logprobs.append(s.logprob)
            if self.n_top:
                self.top.append(s.top_logprobs)

    def wire(self) -> tuple[list[float | None], list[dict[int, float] | None] | None]:
        """(logprob per prompt position, top dict per position or None when ``n_top`` is 0), both
        ``num_prompt`` long with None at position 0 (`RequestOutput.prompt_logprobs`)."""
        return [None, *self.logprobs], ([None, *self.top] if self.n_top else None)


class PromptRows:
    """The prompt-logprob rows of one prefill forward, gathered over the requests that asked."""

    def __init__(self) -> None:
        self.owners: list[tuple[PromptLogprobs, int]] = []  # (record, row count), in row order
        self.rows: list[int] = []  # rows of the forward's hidden states
        self.targets: list[int] = []  # the token each row's logprob is of

    def __bool__(self) -> bool:
        return bool(self.rows)

    def add(self, state: PromptLogprobs, prompt: list[int], start: int, end: int, row0: int) -> None:
        """A chunk over positions ``[start, end)`` of ``prompt`` whose hidden states are the
        forward's rows ``row0 ..`` (positions past the prompt, a re-prefill's outputs, are skipped)."""
        lo, hi = state.take_rows(start, end)
        if hi > lo:
            self.rows += range(row0 + lo - start, row0 + hi - start)
            self.targets += prompt[lo + 1:hi + 1]
            self.owners.append((state, hi - lo))

    def compute(self, logits_fn: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, vocab_size: int,
                rows_per_block: int | None = None) -> torch.Tensor:
        """fp32 ``[M, 2 + 2N]`` packed rows (N: the largest ``n_top`` asked) on the logits' device.

        logits_fn: hidden ``[m, hidden]`` -> fp32 logits ``[m, vocab_size]`` (the model's head);
        hidden: the forward's ``[T, hidden]``. rows_per_block: rows through the head at a
        time (default: `LOGITS_BUDGET` // vocab_size)."""
        n_top = max(s.n_top for s, _ in self.owners)
        block = rows_per_block or max(1, LOGITS_BUDGET // vocab_size)
        idx = tensor_on(self.rows, torch.int64, hidden.device)
        targets = torch.tensor(self.targets, dtype=torch.int64)
        out = []
        for at in range(0, len(self.rows), block):
            logits = logits_fn(hidden.index_select(0, idx[at:at + block]))
            tgt = to_device(targets[at:at + block], logits.device)
            lse = torch.logsumexp(logits, dim=-1)
            cols = [tgt.float()[:, None], (logits.gather(1, tgt[:, None]).squeeze(1) - lse)[:, None]]
            if n_top:
                vals, ids = logits.topk(n_top, dim=-1)
                cols += [ids.float(), vals - lse[:, None]]
            out.append(torch.cat(cols, dim=1))
        return torch.cat(out)

    def split(self, packed: torch.Tensor) -> list[tuple[PromptLogprobs, torch.Tensor]]:
        """Each record with its rows of ``packed`` (device slices)."""
        out, at = [], 0
        for state, n in self.owners:
            out.append((state, packed[at:at + n]))
            at += n
        return out

    def emit(self, host_rows: list[list[float]], outs=None) -> None:
        """Hand the host copy of `compute`'s rows to their records (the engine's read-back hook;
        ``outs`` unused: the values leave with the request's first token, `Engine._emit`)."""
        at = 0
        for state, n in self.owners:
            state.add_rows(host_rows[at:at + n])
            at += n
