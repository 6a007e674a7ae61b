"""Lightning indexer, reference backend: plain fp32 torch.

The indexer scores every visible key for every query row::

    logit[row, t] = sum_h weights[row, h] * relu(q[row, h] . k_fp8[t]) * k_scale[t]

(the DeepGEMM formula; since ``k_scale >= 0`` it equals
``sum_h w * relu(q . k_dequantized)``). ``weights`` are used as given: the
caller folds the softmax scale, the head-count factor and any q scale into them.
Positions a row cannot see are set to ``-inf`` explicitly.

Then :func:`topk_slots` picks the top-k positions per row and maps them through
the page table to the slots FlashMLA's sparse decode reads.

Tie rule (both backends, every batch layout): among equal logits the lower
position is selected first. A row's selection therefore depends on its own
candidates only, never on the width of the logits tensor or on the other rows
of the batch (``torch.topk`` alone breaks exact ties differently at different
row widths, so a request's output would change with what it is batched with).
"""

from __future__ import annotations

import torch

from .formats import PAGE_SIZE, IndexerFp8Format, unpack_indexer_page

NEG_INF = float("-inf")


def _as_f32(x: torch.Tensor) -> torch.Tensor:
    # fp8 (or bf16) inputs are upcast exactly; the math is fp32 throughout.
    return x.float()


def _gather_pages(index_cache_layer: torch.Tensor, pages: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys of the given pages.

    Args:
        index_cache_layer: fp8: uint8 ``[P, 64 * (D + 4)]`` or ``(P, 64, 1, D + 4)``;
            auto: float ``[P, 64, D]`` or ``(P, 64, 1, D)``.
        pages: int64 ``[...]`` page ids, all in ``[0, P)``.

    Returns:
        ``(k f32 [..., 64, D], k_scale f32 [..., 64])``; the scale is all ones for
        an unquantized cache.
    """
    if index_cache_layer.dtype == torch.uint8:
        fmt = IndexerFp8Format(head_dim)
        flat = index_cache_layer.reshape(index_cache_layer.shape[0], -1)
        if flat.shape[1] != fmt.bytes_per_page:
            raise ValueError(
                f"fp8 indexer pages of {flat.shape[1]} bytes do not match head_dim {head_dim} "
                f"({fmt.bytes_per_page} bytes per page)"
            )
        k_fp8, scale = unpack_indexer_page(flat[pages.reshape(-1)], fmt)
        return (
            _as_f32(k_fp8).view(*pages.shape, PAGE_SIZE, head_dim),
            scale.view(*pages.shape, PAGE_SIZE),
        )
    cache = index_cache_layer.reshape(index_cache_layer.shape[0], PAGE_SIZE, -1)
    if cache.shape[2] != head_dim:
        raise ValueError(f"indexer cache head_dim {cache.shape[2]} != q head_dim {head_dim}")
    k = _as_f32(cache[pages])
    return k, torch.ones(k.shape[:-1], dtype=torch.float32, device=k.device)


def _head_weighted_sum(scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_h weights[..., h] * scores[..., h, :]``, bit-identical whatever the width.

    Batch invariance: a row's logits must not depend on the number of keys the
    tensor holds (the longest request of a decode batch sets it) or on the
    other rows. ``scores [..., H, T]`` come from matmuls over at least 64 keys
    (the callers pad the keys to whole pages: torch's CPU matmul sums a dot
    product in another order when fewer than ~12 columns are asked for). The
    head sum runs one head at a time, as elementwise ops, because
    ``(scores * w).sum(dim=-2)`` adds in an order that depends on ``T``.
    """
    out = scores[..., 0, :] * weights[..., 0, None]
    for h in range(1, scores.shape[-2]):
        out = out + scores[..., h, :] * weights[..., h, None]
    return out


def paged_mqa_logits(
    q: torch.Tensor,
    index_cache_layer: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    page_table: torch.Tensor,
    max_len: int,
) -> torch.Tensor:
    """Indexer logits of decode rows over their paged context (DeepGEMM ``fp8_paged_mqa_logits``).

    Args:
        q: ``[B, next_n, H, D]`` float or float8_e4m3fn (upcast exactly).
        index_cache_layer: ``PagedKVCache.index[layer]`` -- fp8: uint8
            ``[P, 64 * (D + 4)]`` (or its ``(P, 64, 1, D + 4)`` kernel view);
            auto: float ``[P, 64, D]`` (or ``(P, 64, 1, D)``).
        weights: f32 ``[B * next_n, H]``, used as given.
        context_lens: int ``[B, next_n]``: keys visible to draft position j of
            request b (``L - next_n + j + 1`` for a request of length L). A 1-D
            ``[B]`` is accepted when ``next_n == 1``.
        page_table: int ``[B, max_pages]``: page of token t of request b is
            ``page_table[b, t // 64]``. Entries past a request's last page are
            never read (they may hold anything, e.g. -1).
        max_len: width of the result; must be >= every context length.

    Returns:
        f32 ``[B * next_n, max_len]``; row ``b * next_n + j``, column t holds the
        logit of token t of request b, ``-inf`` for ``t >= context_lens[b, j]``.
    """
    if q.dim() != 4:
        raise ValueError(f"expected q [B, next_n, H, D], got {tuple(q.shape)}")
    B, next_n, H, D = q.shape
    ctx = torch.as_tensor(context_lens, device=q.device).long()
    if ctx.dim() == 1 and next_n == 1:
        ctx = ctx[:, None]
    if ctx.shape != (B, next_n):
        raise ValueError(f"context_lens must be [B, next_n] = [{B}, {next_n}], got {tuple(ctx.shape)}")
    if weights.shape != (B * next_n, H):
        raise ValueError(f"weights must be [B*next_n, H] = [{B * next_n}, {H}], got {tuple(weights.shape)}")
    bt = torch.as_tensor(page_table, device=q.device).long()
    if bt.dim() != 2 or bt.shape[0] != B:
        raise ValueError(f"page_table must be [B, max_pages] with B = {B}, got {tuple(bt.shape)}")
    if bool((ctx < 0).any()):
        raise ValueError("context_lens must be >= 0")
    if B * next_n and int(ctx.max()) > max_len:
        raise ValueError(f"a context length ({int(ctx.max())}) exceeds max_len ({max_len})")

    n_pages = -(-max_len // PAGE_SIZE)
    if bt.shape[1] < n_pages:  # a narrow table is fine as long as no visible token falls beyond it
        bt = torch.nn.functional.pad(bt, (0, n_pages - bt.shape[1]), value=-1)
    bt = bt[:, :n_pages]
    # Every page holding a visible token must exist; the rest are masked, so clamp them.
    needed = torch.arange(n_pages, device=q.device)[None, :] * PAGE_SIZE < ctx.amax(dim=1, keepdim=True)
    num_pool_pages = index_cache_layer.shape[0]
    if bool((needed & ((bt < 0) | (bt >= num_pool_pages))).any()):
        raise IndexError(f"page_table points outside the pool [0, {num_pool_pages}) for a visible token")
    k, k_scale = _gather_pages(index_cache_layer, bt.clamp(0, num_pool_pages - 1), D)
    k = k.reshape(B, n_pages * PAGE_SIZE, D)  # whole pages: see _head_weighted_sum
    k_scale = k_scale.reshape(B, n_pages * PAGE_SIZE)[:, :max_len]

    # [B, next_n * H, D] x [B, D, pages * 64]: one matmul per request.
    scores = torch.bmm(_as_f32(q).reshape(B, next_n * H, D), k.transpose(1, 2)).relu_()
    scores = scores[..., :max_len].reshape(B, next_n, H, max_len)
    logits = _head_weighted_sum(scores, weights.float().view(B, next_n, H)) * k_scale[:, None, :]  # [B, next_n, T]
    pos = torch.arange(max_len, device=q.device)
    logits = logits.masked_fill(pos >= ctx[..., None], NEG_INF)
    return logits.reshape(B * next_n, max_len)


def ragged_mqa_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor | None,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
) -> torch.Tensor:
    """Indexer logits of packed prefill rows over packed keys (DeepGEMM ``fp8_mqa_logits``).

    Args:
        q: ``[S, H, D]`` float or float8_e4m3fn.
        k: ``[N, D]`` float or float8_e4m3fn (the keys of every packed request).
        k_scale: f32 ``[N]`` per-key scale, or None (keys already dequantized).
        weights: f32 ``[S, H]``, used as given.
        ks, ke: int ``[S]``: row s sees keys ``[ks[s], ke[s])`` (its request's
            start and its causal end).

    Returns:
        f32 ``[S, N]``, ``-inf`` outside ``[ks, ke)``.
    """
    if q.dim() != 3 or k.dim() != 2 or k.shape[1] != q.shape[2]:
        raise ValueError(f"expected q [S, H, D] and k [N, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    S, H, D = q.shape
    N = k.shape[0]
    if weights.shape != (S, H):
        raise ValueError(f"weights must be [S, H] = [{S}, {H}], got {tuple(weights.shape)}")
    ks = torch.as_tensor(ks, device=q.device).long().reshape(-1)
    ke = torch.as_tensor(ke, device=q.device).long().reshape(-1)
    if ks.numel() != S or ke.numel() != S:
        raise ValueError(f"ks and ke must have S = {S} entries")
    n_pad = max(PAGE_SIZE, -(-N // PAGE_SIZE) * PAGE_SIZE)  # see _head_weighted_sum
    k_pad = torch.nn.functional.pad(_as_f32(k), (0, 0, 0, n_pad - N))
    scores = torch.einsum("shd,nd->shn", _as_f32(q), k_pad)[..., :N].relu_()
    logits = _head_weighted_sum(scores, weights.float())
    if k_scale is not None:
        logits = logits * k_scale.float().reshape(1, N)
    pos = torch.arange(N, device=q.device)
    visible = (pos[None, :] >= ks[:, None]) & (pos[None, :] < ke[:, None])
    return logits.masked_fill(~visible, NEG_INF)


def _selection_key(logits: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """int64 ``[R, L]`` keys whose descending order is the selection order.

    High 32 bits: the fp32 logit's order-preserving key (positive floats get
    the sign bit set, negative ones are bit-inverted; ``-0.0`` is folded onto
    ``+0.0`` and every NaN onto the largest key, as the cuda kernels'
    ``float_order_key``), shifted to a signed range. Low 32 bits: ``2^32 - 1 -
    position``, so equal logits rank the lower position higher and every key
    of a row is distinct (``torch.topk`` over them has nothing left to break).
    """
    bits = logits.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    bits = torch.where(logits == 0, 0, bits)
    order = torch.where(bits >= 1 << 31, bits ^ 0xFFFFFFFF, bits | (1 << 31))
    order = torch.where(torch.isnan(logits), 0xFFFFFFFF, order)
    return (order - (1 << 31)) * (1 << 32) + ((1 << 32) - 1 - pos)[None, :]


def topk_slots(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    topk: int,
    page_table_rows: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k positions per row and their cache slots.

    A position t of row r is a candidate iff ``t < lengths[r]`` and its logit is
    not ``-inf`` (so ragged rows masked outside ``[ks, ke)`` work with
    ``lengths = ke``).

    Args:
        logits: f32 ``[R, L]``.
        lengths: int ``[R]``, each in ``[0, L]``.
        topk: k > 0; may exceed L or a row's candidate count.
        page_table_rows: int ``[R, max_pages]``, the page table of each row's
            request (repeat a request's row for each of its next_n draft rows);
            None returns the positions themselves as slots (contiguous kv, e.g.
            sparse prefill).

    Returns:
        ``(positions int32 [R, topk], slots int32 [R, topk])``: candidates in
        descending logit order, equal logits in ascending position order (so of
        a tie straddling the k-th place the lowest positions are selected), then
        ``-1`` padding where a row has fewer than topk candidates. ``-0.0``
        equals ``+0.0``; NaN ranks above ``+inf``. Rows are independent: a
        row's result depends neither on ``L`` nor on the other rows.
        ``slot = page_table_rows[r, t // 64] * 64 + t % 64``; ``-1`` where the
        position is ``-1``.
    """
    if logits.dim() != 2:
        raise ValueError(f"expected logits [R, L], got {tuple(logits.shape)}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    R, L = logits.shape
    dev = logits.device
    lengths = torch.as_tensor(lengths, device=dev).long().reshape(-1)
    if lengths.numel() != R or bool(((lengths < 0) | (lengths > L)).any()):
        raise ValueError(f"lengths must be [R] = [{R}] with values in [0, {L}]")

    pos = torch.arange(L, device=dev)
    candidate = (pos[None, :] < lengths[:, None]) & (logits != NEG_INF)
    # One distinct int64 key per position: the logit's order in the high 32
    # bits, the inverted position in the low 32 (equal logits: lower position
    # ranks higher). Non-candidates get the smallest int64, below every
    # candidate (even a NaN one); they come last and are turned into -1 below.
    key = _selection_key(logits.float(), pos).masked_fill(~candidate, torch.iinfo(torch.int64).min)
    k = min(topk, L)
    _, order = key.topk(k, dim=1, sorted=True)
    positions = torch.full((R, topk), -1, dtype=torch.long, device=dev)
    positions[:, :k] = torch.where(candidate.gather(1, order), order, -1)

    if page_table_rows is None:
        slots = positions.clone()
    else:
        bt = torch.as_tensor(page_table_rows, device=dev).long()
        if bt.dim() != 2 or bt.shape[0] != R:
            raise ValueError(f"page_table_rows must be [R, max_pages] with R = {R}, got {tuple(bt.shape)}")
        valid = positions >= 0
        page_idx = torch.where(valid, positions // PAGE_SIZE, 0)
        if bool((valid & (page_idx >= bt.shape[1])).any()):
            raise IndexError("a chosen position lies beyond its row's block table")
        if bt.shape[1] == 0:  # no pages at all: every position is -1 (checked above)
            bt = torch.full((R, 1), -1, dtype=torch.long, device=dev)
        page = bt.gather(1, page_idx)
        if bool((valid & (page < 0)).any()):
            raise IndexError("a chosen position maps to an invalid (-1) page")
        slots = torch.where(valid, page * PAGE_SIZE + positions % PAGE_SIZE, -1)
    return positions.to(torch.int32), slots.to(torch.int32)
