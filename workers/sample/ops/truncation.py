"""Top-k / top-p / min-p truncation and the inverse-CDF draw, batched over rows.

Every truncation keeps a most-likely *prefix* of a row sorted by probability,
so in sorted order one count per row (``n_keep``) describes all three and
the draw is one ``searchsorted`` into the cumulative sums the truncation
already computed. Rows are sorted with a *stable* sort: tied logits (common
in bf16 logits) keep vocabulary order, so which of two tied tokens a uniform
picks is the same on every device and in every batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SortedDist:
    """Rows of a distribution in descending-probability order, truncated.

    probs: fp32 ``[N, V]`` softmax probabilities (of the whole row, not
    renormalised), 0 from position ``n_keep`` on; cdf: fp32 ``[N, V]`` their
    cumulative sums; order: int64 ``[N, V]`` the vocabulary id at each sorted
    position; n_keep: int64 ``[N]`` kept tokens (>= 1); total: fp32 ``[N]``
    the kept mass (``cdf[n_keep - 1]``).
    """

    probs: torch.Tensor
    cdf: torch.Tensor
    order: torch.Tensor
    n_keep: torch.Tensor
    total: torch.Tensor

    def vocab_probs(self) -> torch.Tensor:
        """fp32 ``[N, V]``: the truncated distribution, renormalised, in vocabulary order."""
        return torch.zeros_like(self.probs).scatter_(1, self.order, self.probs / self.total[:, None])


def sorted_truncation(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      min_p: torch.Tensor) -> SortedDist:
    """Truncate temperature-scaled fp32 logits ``[N, V]``.

    top_k: int64 ``[N]`` (0 = off); top_p, min_p: fp32 ``[N]`` (1, 0 = off).
    Top-k and min-p first (both keep the same set whatever the
    normalisation), then top-p on the renormalised rest: the smallest prefix
    whose mass reaches ``top_p`` of the kept mass (at least one token).
    """
    n, v = scaled.shape
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    cdf = probs.cumsum(dim=-1)
    k = torch.where(top_k > 0, top_k.clamp(max=v), v)
    # Sorted descending: the tokens at least min_p times the first one's probability are a prefix.
    m = (probs >= (min_p * probs[:, 0])[:, None]).sum(dim=-1)
    n1 = torch.minimum(k, m).clamp(min=1)
    mass = cdf.gather(1, (n1 - 1)[:, None])
    # Position i is kept while the mass before it is below top_p of the kept mass.
    p = ((cdf - probs) < top_p[:, None] * mass).sum(dim=-1)
    n_keep = torch.minimum(n1, p).clamp(min=1)
    pos = torch.arange(v, device=scaled.device)
    probs = probs.masked_fill(pos[None, :] >= n_keep[:, None], 0.0)
    total = cdf.gather(1, (n_keep - 1)[:, None]).squeeze(1)
    return SortedDist(probs, cdf, order, n_keep, total)


def inverse_cdf(cdf: torch.Tensor, total: torch.Tensor, u: torch.Tensor, n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[N]``: for each row the first position whose cumulative mass exceeds
    ``u * total``, i.e. a draw from the (unnormalised) probabilities whose
    running sums are ``cdf`` (fp32 ``[N, M]``, non-decreasing).

    total: fp32 ``[N]`` the mass to draw from (the last cdf value, or the
    kept prefix's); u: fp32 ``[N]`` uniforms in (0, 1); n_valid: int64 ``[N]``
    positions allowed (the result is clamped below it; default all).
    """
    # u < 1, but u * total can round up to total: stay strictly below it so
    # the search lands on a position that adds mass.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, target[:, None].contiguous(), right=True).squeeze(1)
    limit = n_valid if n_valid is not None else torch.full_like(idx, cdf.shape[1])
    return torch.minimum(idx, limit - 1)


def draw_vocab(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """int64 ``[N]``: one token per row of fp32 probabilities ``[N, V]`` in vocabulary
    order (need not sum to 1; zeros anywhere), by inverse CDF with uniforms
    ``u`` fp32 ``[N]``.

    A parallel scan (CUDA's cumsum) may round a zero-probability token's
    running sum above its predecessor's; such a pick (a ~1e-7 event) is
    replaced by the row's most likely token rather than a token the
    truncation removed.
    """
    cdf = probs.cumsum(dim=-1)
    idx = inverse_cdf(cdf, cdf[:, -1], u)
    picked = probs.gather(1, idx[:, None]).squeeze(1)
    return torch.where(picked > 0, idx, probs.argmax(dim=-1))
