"""The batched sampler: one call chooses a token for every row of a batch, on the logits' device.

Pipeline per row: the grammar mask (structured outputs, `ops.grammar_mask`),
``logit_bias`` and ``min_tokens`` blocks, then penalties on
the raw logits (greedy rows too), then either argmax (temperature 0) or
temperature → top-k / min-p → top-p → one draw.

The draw is an **inverse CDF** with one counter-based uniform per row
(`workers.sample.ops.rng`): the first token whose cumulative probability
exceeds ``u`` times the kept mass. Chosen over an exponential race
(``argmax(p / Exp(1))``, vLLM's) because it needs one random number per row
rather than one per vocabulary entry — the hash is a dozen int64 kernels, run
over ``R`` values instead of ``R x V`` — and its cumulative sums are the ones
top-p computes anyway. A row with top-k or top-p is stably sorted (ties in
vocabulary order) and draws in sorted order; a row without draws in
vocabulary order and pays no sort. Which way depends on the row alone, so a
seeded row draws the same token whatever else is in its batch (on CPU
exactly; on CUDA as far as a row kernel's rounding does not depend on the
batch's shape).

Top-k keeps exactly ``k`` tokens (ties at the boundary: lowest ids first).
Log-probabilities are those of the raw logits (before biases, penalties and
temperature), as the engine always reported them. Nothing here reads the
device: the caller reads a step's results back once (`workers.sample.output`).
"""

from __future__ import annotations

import torch

from workers.sample.metadata import Penalties, RowParams, SamplingMetadata, TokenHistory
from workers.sample.ops.penalties import apply_penalties
from workers.sample.ops.rng import uniforms
from workers.sample.ops.truncation import draw_vocab, inverse_cdf, sorted_truncation
from workers.sample.output import SampleOutput


def penalised(logits: torch.Tensor, penalties: Penalties | None, history: TokenHistory | None) -> torch.Tensor:
    """fp32 logits ``[R, V]`` with each row's penalties applied (``logits`` itself when none)."""
    if penalties is None:
        return logits
    if history is None:
        raise ValueError("a row uses penalties but no token history was given")
    counts, seen = history.counts(logits.shape[-1])
    return apply_penalties(logits, counts, seen, penalties.presence, penalties.frequency, penalties.repetition)


def distribution(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """fp32 ``[N, V]``: the distribution a row draws from (temperature, truncations,
    renormalised), in vocabulary order. logits: fp32 ``[N, V]`` (penalised)."""
    if rows.mixed is not None:
        return _by_kind(logits, rows, _distribution)
    return _distribution(logits, rows)


def draw(logits: torch.Tensor, rows: RowParams, u: torch.Tensor, want_probs: bool = False
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token per row of penalised fp32 logits ``[N, V]`` with uniforms ``u`` fp32 ``[N]``.

    Returns (int64 ``[N]`` tokens, the fp32 ``[N, V]`` distribution drawn from
    in vocabulary order when ``want_probs``, else None).
    """
    if rows.mixed is None:
        return _draw(logits, rows, u, want_probs)
    s_idx, v_idx = rows.mixed
    t_s, p_s = _draw(logits.index_select(0, s_idx), rows.select(s_idx, True), u.index_select(0, s_idx), want_probs)
    t_v, p_v = _draw(logits.index_select(0, v_idx), rows.select(v_idx, False), u.index_select(0, v_idx), want_probs)
    tokens = torch.empty_like(u, dtype=torch.int64).index_copy_(0, s_idx, t_s).index_copy_(0, v_idx, t_v)
    probs = None
    if want_probs:
        probs = torch.empty_like(logits).index_copy_(0, s_idx, p_s).index_copy_(0, v_idx, p_v)
    return tokens, probs


def _by_kind(logits: torch.Tensor, rows: RowParams, fn) -> torch.Tensor:
    """``fn(logits, rows)`` ``[N, V]`` run separately on the sorted and the vocabulary-order rows."""
    s_idx, v_idx = rows.mixed
    out = torch.empty_like(logits)
    out.index_copy_(0, s_idx, fn(logits.index_select(0, s_idx), rows.select(s_idx, True)))
    return out.index_copy_(0, v_idx, fn(logits.index_select(0, v_idx), rows.select(v_idx, False)))


def _distribution(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    scaled = logits / rows.temperature[:, None]
    if rows.truncate:
        return sorted_truncation(scaled, rows.top_k, rows.top_p, rows.min_p).vocab_probs()
    probs = _min_p(torch.softmax(scaled, dim=-1), rows)
    return probs / probs.sum(dim=-1, keepdim=True)


def _draw(logits: torch.Tensor, rows: RowParams, u: torch.Tensor, want_probs: bool
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`draw` for rows of one kind (``rows.mixed`` is None)."""
    scaled = logits / rows.temperature[:, None]
    if rows.truncate:
        d = sorted_truncation(scaled, rows.top_k, rows.top_p, rows.min_p)
        pos = inverse_cdf(d.cdf, d.total, u, d.n_keep)
        tokens = d.order.gather(1, pos[:, None]).squeeze(1)
        return tokens, d.vocab_probs() if want_probs else None
    probs = _min_p(torch.softmax(scaled, dim=-1), rows)
    tokens = draw_vocab(probs, u)
    return tokens, probs / probs.sum(dim=-1, keepdim=True) if want_probs else None


def _min_p(probs: torch.Tensor, rows: RowParams) -> torch.Tensor:
    if not rows.use_min_p:
        return probs
    floor = rows.min_p * probs.amax(dim=-1)
    return probs.masked_fill(probs < floor[:, None], 0.0)


def sample(logits: torch.Tensor, meta: SamplingMetadata, history: TokenHistory | None = None, *,
           draw_index: int = 0, want_logprobs: bool = True, want_probs: bool = False) -> SampleOutput:
    """One token for each row of fp32 logits ``[R, V]`` (rows in ``meta``'s order).

    history: the rows' tokens, needed when ``meta.penalties`` is set.
    draw_index: which of its draws this is for each row, counted from the
    row's offset (row ``r`` uses the uniform of ``(seed_r, offset_r +
    draw_index, 0)``; an MTP step's draft steps use 0..k-1).
    want_logprobs: the chosen tokens' and top log-probabilities (drafts skip them).
    want_probs: also return the drawing rows' distributions (an MTP draft's ``q``).
    """
    if logits.shape[0] != meta.num_rows:
        raise ValueError(f"{logits.shape[0]} rows of logits for {meta.num_rows} rows of sampling metadata")
    raw = logits
    if meta.grammar is not None:  # structured outputs: disallowed tokens are -inf before anything else
        logits = meta.grammar.apply(logits)
    if meta.bias is not None:
        logits = meta.bias.apply(logits)
    logits = penalised(logits, meta.penalties, history)
    probs = None
    if meta.all_greedy:
        tokens = logits.argmax(dim=-1)  # the fast path: nothing else runs
    else:
        rows = meta.sampled_rows
        sub = logits if rows is None else logits.index_select(0, rows)
        u = uniforms(meta.seed, meta.offset + draw_index)
        drawn, probs = draw(sub, meta.rows, u, want_probs)
        tokens = drawn if rows is None else logits.argmax(dim=-1).index_copy(0, rows, drawn)
    if not want_logprobs:
        return SampleOutput(tokens, None, None, None, probs)
    lse = torch.logsumexp(raw, dim=-1)
    chosen = raw.gather(1, tokens[:, None]).squeeze(1) - lse
    top_ids = top_lp = None
    if meta.max_top_logprobs:
        top_vals, top_ids = raw.topk(meta.max_top_logprobs, dim=-1)
        top_lp = top_vals - lse[:, None]
    return SampleOutput(tokens, chosen, top_ids, top_lp, probs)


def sample_hidden(model, hidden: torch.Tensor, meta: SamplingMetadata, history: TokenHistory | None = None
                  ) -> SampleOutput:
    """``sample(model.logits(hidden), meta, history)``: the head over hidden ``[n, hidden]``, one token
    per row. A model sharded over rank workers (`workers.rank_group.GroupModel`) runs both on its rank 0,
    where the head's weights and a GPU are, and sends back only the sampled rows."""
    on_rank = getattr(model, "sample_hidden", None)
    if on_rank is not None:
        return on_rank(hidden, meta, history)
    return sample(model.logits(hidden), meta, history)

