"""A batch's sampling inputs as device tensors: per-row parameters and token history.

Built once per sampling call from the requests' `SamplingParams`, seeds and
offsets with a few host lists and one small host-to-device copy per dtype;
nothing at all is copied for rows that need nothing (an all-greedy batch
without penalties or top log-probabilities builds no tensor).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from workers.host_copy import tensor_on, to_device
from workers.sample.ops.grammar_mask import GrammarMask
from workers.sample.ops.logit_bias import UNTIL_ALWAYS, LogitBias
from workers.sample.ops.penalties import token_counts
from workers.sample.ops.rng import to_int64
from workers.sample.params import SamplingParams


@dataclass
class RowParams:
    """Parameters of the rows that draw (``S`` of them), on the device.

    temperature, top_p, min_p: fp32 ``[S]``; top_k: int64 ``[S]`` (0 = off).
    A row with top-k or top-p draws in sorted order, the others in
    vocabulary order; which way is the row's own business, never its
    batch's (a seeded row draws the same token in any batch). truncate: the
    rows draw sorted (all of them, or with ``mixed`` those it lists); mixed:
    (int64 positions of the sorted rows, of the vocabulary-order rows) when
    there are both kinds, else None. use_min_p: some row uses min-p. The flags
    are known on the host when the batch is built.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    truncate: bool
    use_min_p: bool
    mixed: tuple[torch.Tensor, torch.Tensor] | None = None

    def select(self, idx: torch.Tensor, truncate: bool) -> "RowParams":
        """The rows at positions ``idx`` (int64), all drawing sorted (``truncate``) or not."""
        return RowParams(*(t.index_select(0, idx) for t in (self.temperature, self.top_k, self.top_p, self.min_p)),
                         truncate, self.use_min_p)

    def repeat(self, n: int) -> "RowParams":
        """Each row ``n`` times in a row (``[S * n]``): one per position of a verify step."""
        mixed = None
        if self.mixed is not None:
            steps = torch.arange(n, device=self.mixed[0].device)
            mixed = tuple((i[:, None] * n + steps).reshape(-1) for i in self.mixed)
        return RowParams(*(t.repeat_interleave(n) for t in (self.temperature, self.top_k, self.top_p, self.min_p)),
                         self.truncate, self.use_min_p, mixed)


@dataclass
class Penalties:
    """fp32 ``[R]`` per-row penalties (0, 0, 1 in rows without any)."""

    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor

    def repeat(self, n: int) -> "Penalties":
        return Penalties(*(t.repeat_interleave(n) for t in (self.presence, self.frequency, self.repetition)))


@dataclass
class SamplingMetadata:
    """Sampling parameters of ``num_rows`` rows (one per request, in batch order).

    sampled_rows: int64 ``[S]`` the rows that draw (temperature > 0), None
    when every row does; rows / seed / offset describe those ``S`` rows
    (seed, offset: int64 ``[S]``; a row's uniforms are a function of its seed
    and ``offset + draw``, see `workers.sample.ops.rng`). None when no row
    draws. penalties: None when no row uses one. top_logprobs: per row, how
    many top log-probabilities it wants (host); ``max_top_logprobs`` their max.
    bias: the rows' ``logit_bias`` entries and ``min_tokens`` blocks, None
    when no row has any. grammar: the constrained rows' token bitmasks
    (structured outputs), None when no row has a grammar; set by the caller
    once its `workers.structured.MaskJob` is done (the masks are filled while
    the forward runs, after this metadata is built).
    """

    num_rows: int
    num_sampled: int
    sampled_rows: torch.Tensor | None
    rows: RowParams | None
    seed: torch.Tensor | None
    offset: torch.Tensor | None
    penalties: Penalties | None
    top_logprobs: tuple[int, ...]
    bias: LogitBias | None = None
    grammar: GrammarMask | None = None

    @property
    def all_greedy(self) -> bool:
        return self.num_sampled == 0

    @property
    def max_top_logprobs(self) -> int:
        return max(self.top_logprobs, default=0)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int | None], offsets: Sequence[int],
              device: torch.device | str, num_output: Sequence[int] | None = None,
              eos_token_ids: Collection[int] = ()) -> "SamplingMetadata":
        """From each row's params, seed (None only for greedy rows) and offset.

        num_output: tokens each row generated so far (default none), and
        eos_token_ids: the model's EOS ids; both only matter to rows with
        ``min_tokens`` (which block EOS and their stop ids until then).
        """
        n = len(params)
        if not len(seeds) == len(offsets) == n:
            raise ValueError(f"{n} params, {len(seeds)} seeds and {len(offsets)} offsets: one each per row")
        drawing = [i for i, p in enumerate(params) if not p.greedy]
        sampled_rows = rows = seed = offset = None
        if drawing:
            floats, ints = [], []
            for i in drawing:
                p, s = params[i], seeds[i]
                if s is None:
                    raise ValueError(f"row {i} samples (temperature {p.temperature}) but has no seed")
                floats.append((p.temperature, p.top_p, p.min_p))
                ints.append((p.top_k, to_int64(s), offsets[i]))
            f = tensor_on(floats, torch.float32, device)
            t = tensor_on(ints, torch.int64, device)
            sorts = [params[i].top_k > 0 or params[i].top_p < 1.0 for i in drawing]
            mixed = None
            if any(sorts) and not all(sorts):
                mixed = tuple(tensor_on([j for j, x in enumerate(sorts) if x == want], torch.int64, device)
                              for want in (True, False))
            rows = RowParams(f[:, 0], t[:, 0], f[:, 1], f[:, 2], truncate=any(sorts),
                             use_min_p=any(params[i].min_p > 0 for i in drawing), mixed=mixed)
            seed, offset = t[:, 1], t[:, 2]
            if len(drawing) < n:
                sampled_rows = tensor_on(drawing, torch.int64, device)
        penalties = None
        if any(p.uses_penalties for p in params):
            pen = tensor_on([(p.presence_penalty, p.frequency_penalty, p.repetition_penalty) for p in params],
                            torch.float32, device)
            penalties = Penalties(pen[:, 0], pen[:, 1], pen[:, 2])
        bias = None
        if any(p.adjusts_logits for p in params):
            bias = _logit_bias(params, num_output or [0] * n, eos_token_ids, device)
        return cls(n, len(drawing), sampled_rows, rows, seed, offset, penalties,
                   tuple(p.top_logprobs for p in params), bias)


def _logit_bias(params: Sequence[SamplingParams], num_output: Sequence[int], eos: Collection[int],
                device: torch.device | str) -> LogitBias | None:
    """The rows' ``logit_bias`` entries (every position) and ``min_tokens`` blocks (``-inf`` on EOS and
    the stop ids for the positions before the row's ``min_tokens``-th token), copied once."""
    ints: list[tuple[int, int, int]] = []
    values: list[float] = []
    for i, (p, done) in enumerate(zip(params, num_output)):
        for tok, b in p.logit_bias:
            ints.append((i, tok, UNTIL_ALWAYS))
            values.append(b)
        left = p.min_tokens - done
        if left > 0:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
            for tok in sorted(stops):
                ints.append((i, tok, left))
                values.append(float("-inf"))
    if not ints:
        return None
    t = tensor_on(ints, torch.int64, device)
    return LogitBias(t[:, 0], t[:, 1], tensor_on(values, torch.float32, device), t[:, 2])


@dataclass
class TokenHistory:
    """The tokens the penalties look at, int64 and padded with -1.

    prompt: ``[R, Lp]`` prompt tokens (for the repetition penalty; a row
    without one may be all padding); output: ``[R, Lo]`` generated tokens.
    """

    prompt: torch.Tensor
    output: torch.Tensor

    @classmethod
    def build(cls, prompts: Sequence[torch.Tensor | Sequence[int] | None],
              outputs: Sequence[torch.Tensor | Sequence[int] | None], device: torch.device | str) -> "TokenHistory":
        """Pad each row on the host (None = no tokens) and copy once per tensor.
        A row given as an int64 CPU tensor (a cached prompt) is copied without a Python loop."""
        return cls(to_device(_padded(prompts), device), to_device(_padded(outputs), device))

    def counts(self, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 ``[R, vocab]`` generated-token counts, bool ``[R, vocab]`` seen in prompt or output)."""
        out = token_counts(self.output, vocab)
        seen = (token_counts(self.prompt, vocab) > 0) | (out > 0)
        return out, seen


def _padded(rows: Sequence[torch.Tensor | Sequence[int] | None]) -> torch.Tensor:
    rows = [r if r is None or isinstance(r, torch.Tensor) else torch.tensor(r, dtype=torch.int64) for r in rows]
    width = max((len(r) for r in rows if r is not None), default=0)
    out = torch.full((len(rows), max(width, 1)), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r is not None and len(r):
            out[i, : len(r)] = r
    return out
