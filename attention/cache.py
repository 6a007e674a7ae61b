"""Paged KV caches of one replica (one rank), per attention layer.

Two caches per layer, both paged with ``PAGE_SIZE`` (64) tokens per page and
addressed by *slot* = ``page_id * 64 + offset`` (``-1`` = invalid / padding):

* ``mla[layer]``   the MLA latent + rope key of every token,
* ``index[layer]`` the lightning-indexer key of every token (``None`` for
  layers that reuse another layer's top-k and own no indexer).

``kv_cache_dtype="fp8"`` stores the byte formats of :mod:`attention.formats`
(what FlashMLA and DeepGEMM read); ``"auto"`` stores unquantized values in the
model dtype (exact-math comparisons, and FlashMLA's bf16 path).

This module only moves and (de)quantizes bytes: no attention math here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import (
    PAGE_SIZE,
    IndexerFp8Format,
    MlaFp8Format,
    dequantize_indexer_fp8,
    dequantize_mla_fp8,
    quantize_indexer_fp8,
    quantize_mla_fp8,
)

KV_CACHE_DTYPES = ("auto", "fp8")
PAGE_LAYOUTS = ("per_layer", "cross_layer")
ALL_LAYERS = -1
"""`CacheRegion.layer` of the one region of a ``cross_layer`` cache (it holds every layer)."""
_AUTO_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class CacheSpec:
    """Geometry of the paged caches of one replica rank.

    Attributes:
        num_layers: attention layers including MTP layer(s).
        num_pages: pages per layer (same page ids in every layer and cache).
        kv_lora_rank: MLA latent width ``r`` (512 for DeepSeek-V3.2).
        rope_dim: rope key width ``d`` (64).
        index_head_dim: indexer key width ``D`` (128).
        kv_cache_dtype: ``"fp8"`` (FlashMLA / DeepGEMM byte formats) or
            ``"auto"`` (unquantized, in ``dtype``).
        dtype: model dtype; ``"auto"`` caches store latent, rope and index keys
            in it. Must be float32, bfloat16 or float16.
        indexer_layers: one bool per layer, True where the layer owns an indexer
            cache (GLM-5 shared-top-k layers do not). ``None`` (default) means
            every layer does; a list is normalised to a tuple.
        page_layout: where a page id's bytes of different layers live.
            ``"per_layer"``: one buffer per layer, a request's pages are one
            block per layer (one transfer descriptor per layer and page run).
            ``"cross_layer"``: one buffer whose page holds every layer's bytes
            back to back, so a run of pages is one block for the whole model
            (one descriptor per run; the kernels then read each layer at a
            page stride of the whole model's page, ~3.08 MB for DeepSeek-V3.2).
            Prefill and decode must use the same one (the handshake compares it).
    """

    num_layers: int
    num_pages: int
    kv_lora_rank: int
    rope_dim: int
    index_head_dim: int
    kv_cache_dtype: str
    dtype: torch.dtype
    indexer_layers: tuple[bool, ...] | None = None
    page_layout: str = "cross_layer"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_pages", "kv_lora_rank", "index_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"CacheSpec.{name} must be a positive int, got {value!r}")
        if isinstance(self.rope_dim, bool) or not isinstance(self.rope_dim, int) or self.rope_dim < 0:
            raise ValueError(f"CacheSpec.rope_dim must be an int >= 0, got {self.rope_dim!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"CacheSpec.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.page_layout not in PAGE_LAYOUTS:
            raise ValueError(f"CacheSpec.page_layout must be one of {PAGE_LAYOUTS}, got {self.page_layout!r}")
        if self.dtype not in _AUTO_DTYPES:
            raise ValueError(f"CacheSpec.dtype must be one of {_AUTO_DTYPES}, got {self.dtype!r}")
        layers = self.indexer_layers
        layers = (True,) * self.num_layers if layers is None else tuple(bool(x) for x in layers)
        if len(layers) != self.num_layers:
            raise ValueError(
                f"CacheSpec.indexer_layers has {len(layers)} entries for {self.num_layers} layers"
            )
        # Frozen dataclass: normalise through object.__setattr__ (keeps it hashable).
        object.__setattr__(self, "indexer_layers", layers)

    @property
    def is_fp8(self) -> bool:
        return self.kv_cache_dtype == "fp8"

    @property
    def mla_format(self) -> MlaFp8Format:
        return MlaFp8Format(self.kv_lora_rank, self.rope_dim)

    @property
    def index_format(self) -> IndexerFp8Format:
        return IndexerFp8Format(self.index_head_dim)

    @property
    def num_slots(self) -> int:
        return self.num_pages * PAGE_SIZE

    def mla_bytes_per_page(self) -> int:
        """Bytes of one MLA page: ``64 * 656`` for fp8 512/64, ``64 * (r + d) * itemsize`` for auto."""
        if self.is_fp8:
            return self.mla_format.bytes_per_page
        return PAGE_SIZE * (self.kv_lora_rank + self.rope_dim) * self.dtype.itemsize

    def index_bytes_per_page(self) -> int:
        """Bytes of one indexer page: ``64 * (D + 4)`` for fp8, ``64 * D * itemsize`` for auto."""
        if self.is_fp8:
            return self.index_format.bytes_per_page
        return PAGE_SIZE * self.index_head_dim * self.dtype.itemsize

    def transfer_formats(self) -> tuple[str, str]:
        """``(kv_format, index_format)``: the page byte formats prefill and decode must share.

        fp8: ``fp8_mla_656`` / ``fp8_index_132`` (bytes per token); auto:
        ``<dtype>_mla_<r + d>`` / ``<dtype>_index_<D>``. The kv format names the
        page layout too (``+index/cross_layer``), since pages are copied as bytes.
        The transfer handshake compares them, and the controller before placement.
        """
        if self.is_fp8:
            kv = f"fp8_mla_{self.mla_format.bytes_per_token}"
            index = f"fp8_index_{self.index_format.bytes_per_token}"
        else:
            dt = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]
            kv, index = f"{dt}_mla_{self.kv_lora_rank + self.rope_dim}", f"{dt}_index_{self.index_head_dim}"
        return f"{kv}+index/{self.page_layout}", index

    def layer_page_bytes(self) -> tuple[int, ...]:
        """Bytes of one page of each layer: MLA bytes, plus indexer bytes where the layer has an indexer."""
        M, I = self.mla_bytes_per_page(), self.index_bytes_per_page()
        return tuple(M + (I if has else 0) for has in self.indexer_layers)

    def page_bytes(self) -> int:
        """Bytes one page id occupies over every layer (a ``cross_layer`` page's size)."""
        return sum(self.layer_page_bytes())


@dataclass(frozen=True)
class CacheRegion:
    """One registrable memory region of a cache, for the transfer layer.

    ``tensor`` is a uint8 view ``[num_pages, bytes_per_page]`` sharing storage
    with the cache; page ``p`` is the contiguous bytes ``tensor[p]``, at
    ``tensor.data_ptr() + p * bytes_per_page``.
    """

    layer: int  # ALL_LAYERS for a cross_layer cache's one region
    kind: str  # "kv": a layer's whole page (MLA bytes, then indexer bytes if the layer has an indexer), or all layers' pages
    tensor: torch.Tensor
    bytes_per_page: int
    num_pages: int

    @property
    def nbytes(self) -> int:
        return self.bytes_per_page * self.num_pages


class PagedKVCache:
    """The paged MLA and indexer caches of every layer of one rank.

    Storage: zero-filled uint8. ``pages[layer]`` is ``[num_pages, M + I]``:
    page ``p`` holds the layer's MLA bytes of its 64 tokens
    (``M = spec.mla_bytes_per_page()``), then its indexer bytes
    (``I = spec.index_bytes_per_page()``, 0 for a layer without an indexer).
    With ``spec.page_layout == "per_layer"`` each ``pages[layer]`` is its own
    buffer, so a run of pages is one contiguous block per layer. With
    ``"cross_layer"`` they are column slices of one buffer ``storage``
    ``[num_pages, sum over layers of (M + I)]``, so a run of pages is one
    block for every layer at once; what a KV push moves as one descriptor.
    The per-kind tensors are views whose page stride is ``pages[layer]``'s::

        mla[layer]    fp8:  uint8 [num_pages, 64, B]   B = MlaFp8Format.bytes_per_token (656)
                      auto: dtype [num_pages, 64, r + d]   (latent then rope)
        index[layer]  fp8:  uint8 [num_pages, 64 * (D + 4)]   (64 x D fp8, then 64 f32 scales)
                      auto: dtype [num_pages, 64, D]
                      None for layers with ``indexer_layers[layer] == False``

    Within a page each kind keeps its byte format (docs in
    :mod:`attention.formats`); FlashMLA, DeepGEMM and the Triton cache
    kernels take the strided views as they are (bit-identical outputs for
    both layouts on the H100, byte offsets up to 27.7 GB included:
    ``bench/page_layout.py``). Slots are ``page_id * 64 + offset``.
    Writes ignore slot ``-1`` (padding tokens); reads return zeros for it.
    Any other slot outside ``[0, num_pages * 64)`` raises ``IndexError``.
    Slots of one write must be distinct.
    """

    def __init__(self, spec: CacheSpec, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.device = torch.device(device)
        r, d, dim = spec.kv_lora_rank, spec.rope_dim, spec.index_head_dim
        P = spec.num_pages
        M = spec.mla_bytes_per_page()
        widths = spec.layer_page_bytes()
        self.storage: torch.Tensor | None = None
        if spec.page_layout == "cross_layer":
            self.storage = torch.zeros(P, spec.page_bytes(), dtype=torch.uint8, device=self.device)
        self.pages: list[torch.Tensor] = []
        self.mla: list[torch.Tensor] = []
        self.index: list[torch.Tensor | None] = []
        start = 0
        for layer, width in enumerate(widths):
            has_index = spec.indexer_layers[layer]
            if self.storage is None:
                page = torch.zeros(P, width, dtype=torch.uint8, device=self.device)
            else:
                page = self.storage[:, start:start + width]
            start += width
            mla_bytes, idx_bytes = page[:, :M], page[:, M:]
            if spec.is_fp8:
                mla = mla_bytes.view(P, PAGE_SIZE, spec.mla_format.bytes_per_token)
                idx = idx_bytes
            else:
                mla = mla_bytes.view(spec.dtype).view(P, PAGE_SIZE, r + d)
                idx = idx_bytes.view(spec.dtype).view(P, PAGE_SIZE, dim) if has_index else None
            self.pages.append(page)
            self.mla.append(mla)
            self.index.append(idx if has_index else None)

    # ------------------------------------------------------------------ helpers

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.spec.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.spec.num_layers})")

    def _index_layer(self, layer: int) -> torch.Tensor:
        self._check_layer(layer)
        t = self.index[layer]
        if t is None:
            raise ValueError(
                f"layer {layer} owns no indexer cache (indexer_layers[{layer}] is False); "
                "it reuses another layer's top-k"
            )
        return t

    def _slots(self, slots: torch.Tensor, checked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots int64 [n] on device, valid bool [n])``; raises on out-of-range slots.

        ``checked=False``: the caller built ``slots`` from page tables, all in range and valid
        (`models.batch.PackedContext`): no check, whose ``any()`` reads the device back and stalls
        the host until every queued kernel has run, and ``valid`` is None."""
        s = torch.as_tensor(slots, device=self.device).reshape(-1).long()
        if not checked:
            return s, None
        bad = (s < -1) | (s >= self.spec.num_slots)
        if bool(bad.any()):
            raise IndexError(
                f"slots {s[bad][:8].tolist()} out of range [0, {self.spec.num_slots}) (and -1 = invalid)"
            )
        return s, s >= 0

    # ------------------------------------------------------------------ MLA

    def write_mla(self, layer: int, slots: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor) -> None:
        """Store tokens' MLA latent ``[n, r]`` and rope ``[n, d]`` (any float dtype) at ``slots [n]``.

        fp8: quantized with :func:`quantize_mla_fp8`; auto: cast to ``spec.dtype``.
        Only the bytes of the written slots change.
        """
        self._check_layer(layer)
        s, valid = self._slots(slots)
        r, d = self.spec.kv_lora_rank, self.spec.rope_dim
        if latent.shape != (s.numel(), r) or rope.shape != (s.numel(), d):
            raise ValueError(
                f"expected latent [{s.numel()}, {r}] and rope [{s.numel()}, {d}], "
                f"got {tuple(latent.shape)} and {tuple(rope.shape)}"
            )
        s, latent, rope = s[valid], latent[valid], rope[valid]
        page, off = s // PAGE_SIZE, s % PAGE_SIZE  # pages are strided: no flat slot view
        if self.spec.is_fp8:
            self.mla[layer][page, off] = quantize_mla_fp8(latent, rope, self.spec.mla_format).to(self.device)
        else:
            self.mla[layer][page, off] = torch.cat([latent, rope], dim=-1).to(device=self.device, dtype=self.spec.dtype)

    def read_mla(self, layer: int, slots: torch.Tensor, checked: bool = True) -> torch.Tensor:
        """float32 ``[n, r + d]`` (latent then rope) of ``slots [n]``, dequantized; slot -1 -> zeros.
        ``checked=False``: slots known valid (see `_slots`)."""
        self._check_layer(layer)
        s, valid = self._slots(slots, checked)
        sc = s.clamp(min=0)
        rows = self.mla[layer][sc // PAGE_SIZE, sc % PAGE_SIZE]
        if self.spec.is_fp8:
            latent, rope = dequantize_mla_fp8(rows, self.spec.mla_format)
            out = torch.cat([latent, rope], dim=-1)
        else:
            out = rows.float()
        return out if valid is None else out.masked_fill(~valid[:, None], 0.0)

    # ------------------------------------------------------------------ indexer

    def _index_parts(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp8 page tensor -> views (key bytes uint8 [P, 64, D], scale bytes uint8 [P, 64, 4]).

        Indexed by ``[slot // 64, slot % 64]``: the key and scale areas of a page
        are separate, so slots cannot be flattened into one dimension.
        """
        fmt = self.spec.index_format
        P = self.spec.num_pages
        keys = t[:, : fmt.scale_offset].view(P, PAGE_SIZE, fmt.head_dim)
        scales = t[:, fmt.scale_offset :].view(P, PAGE_SIZE, 4)
        return keys, scales

    def write_index(self, layer: int, slots: torch.Tensor, k: torch.Tensor) -> None:
        """Store indexer keys ``k [n, D]`` (any float dtype) at ``slots [n]``.

        fp8: per-token quantized (:func:`quantize_indexer_fp8`), key bytes into the
        page's key area and the scale into its scale area; auto: cast to ``spec.dtype``.
        """
        t = self._index_layer(layer)
        s, valid = self._slots(slots)
        if k.shape != (s.numel(), self.spec.index_head_dim):
            raise ValueError(f"expected k [{s.numel()}, {self.spec.index_head_dim}], got {tuple(k.shape)}")
        s, k = s[valid], k[valid]
        if self.spec.is_fp8:
            k_fp8, scale = quantize_indexer_fp8(k)
            keys, scales = self._index_parts(t)
            page, off = s // PAGE_SIZE, s % PAGE_SIZE
            keys[page, off] = k_fp8.view(torch.uint8).to(self.device)
            scales[page, off] = scale.view(torch.uint8).view(-1, 4).to(self.device)
        else:
            t[s // PAGE_SIZE, s % PAGE_SIZE] = k.to(device=self.device, dtype=self.spec.dtype)

    def read_index(self, layer: int, slots: torch.Tensor, checked: bool = True) -> torch.Tensor:
        """float32 ``[n, D]`` indexer keys of ``slots [n]``, dequantized; slot -1 -> zeros.
        ``checked=False``: slots known valid (see `_slots`)."""
        t = self._index_layer(layer)
        s, valid = self._slots(slots, checked)
        sc = s.clamp(min=0)
        if self.spec.is_fp8:
            keys, scales = self._index_parts(t)
            page, off = sc // PAGE_SIZE, sc % PAGE_SIZE
            out = dequantize_indexer_fp8(keys[page, off], scales[page, off].contiguous().view(torch.float32)[:, 0])
        else:
            out = t[sc // PAGE_SIZE, sc % PAGE_SIZE].float()
        return out if valid is None else out.masked_fill(~valid[:, None], 0.0)

    # ------------------------------------------------------------------ kernel views

    def mla_view_for_kernel(self, layer: int) -> torch.Tensor:
        """FlashMLA's view of a layer's MLA pool, sharing storage.

        fp8: uint8 ``(num_pages, 64, 1, B)``; auto: ``dtype (num_pages, 64, 1, r + d)``
        (FlashMLA's bf16 kv-cache layout).
        """
        self._check_layer(layer)
        return self.mla[layer].unsqueeze(2)

    def index_view_for_kernel(self, layer: int) -> torch.Tensor:
        """DeepGEMM's view of a layer's indexer pool, sharing storage.

        fp8: uint8 ``(num_pages, 64, 1, D + 4)`` -- only a reinterpretation of each
        ``64 * (D + 4)``-byte page (keys first, then scales), not a per-token
        interleave; auto: ``dtype (num_pages, 64, 1, D)``.
        """
        t = self._index_layer(layer)
        if self.spec.is_fp8:
            return t.view(self.spec.num_pages, PAGE_SIZE, 1, self.spec.index_format.bytes_per_token)
        return t.unsqueeze(2)

    # ------------------------------------------------------------------ transfer

    def regions(self) -> list[CacheRegion]:
        """The cache's memory as ``"kv"`` :class:`CacheRegion` s.

        ``per_layer``: one per layer, in layer order; a page carries the
        layer's MLA bytes and, if it has an indexer, its indexer bytes, so a
        run of pages pushed is one descriptor per layer. ``cross_layer``: one
        region (``layer=ALL_LAYERS``) whose page carries every layer's bytes,
        so a run of pages is one descriptor.
        """
        P = self.spec.num_pages
        if self.storage is not None:
            return [CacheRegion(layer=ALL_LAYERS, kind="kv", tensor=self.storage,
                                bytes_per_page=self.storage.shape[1], num_pages=P)]
        return [CacheRegion(layer=layer, kind="kv", tensor=page, bytes_per_page=page.shape[1], num_pages=P)
                for layer, page in enumerate(self.pages)]
