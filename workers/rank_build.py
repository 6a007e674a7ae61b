"""One rank of a replica, built from a typed spec: its model shard, paged caches,
runner and (on request) its NIXL link.

Every place that loads a model to serve it goes through `build_rank`: the
offline ``LLM`` and a Serve replica (one rank, in-process) and a
tensor-parallel rank worker (``workers.rank_worker``, one per rank). The
controller's memory plan sizes caches with the same `RankSpec.cache_spec`
that `build_rank` allocates, so what ``dsa-pd check`` prints is what loading
allocates.
"""

from __future__ import annotations

from dataclasses import dataclass

from attention.backend import get_backend
from attention.cache import CacheSpec, PagedKVCache
from models.config import ModelConfig
from models.dtypes import DtypeName, torch_dtype
from models.fused_projections import fuse_projections
from models.loader import load_model
from models.model import DsaForCausalLM
from models.parallel import SINGLE, TPContext
from models.two_batch import TwoBatchOverlap
from workers.kv_link import KVLink
from workers.model_runner import ModelRunner
from workers.push_tuning import PushTuning


@dataclass(frozen=True)
class RankSpec:
    """What every rank of one replica loads (the rank index is separate).

    dtype: weights and activations (`models.dtypes`); kv_cache_dtype: ``"auto"``
    (caches in ``dtype``, exact math) | ``"fp8"`` (the serving byte formats);
    num_pages: pages of this rank's cache (the replica's one page pool hands out their ids);
    hadamard: rotate indexer keys/queries; None: only where they are quantized
    (``kv_cache_dtype == "fp8"``), as transformers' reference skips it in exact mode;
    with_mtp: load the checkpoint's MTP layer(s) and give them cache layers;
    two_batch_overlap: run each eager forward as two micro-batches whose all-reduces overlap the
    other's compute (`models.two_batch`; tensor parallel only).
    """

    model_dir: str
    backend: str = "reference"
    device: str = "cpu"
    dtype: DtypeName = "float32"
    kv_cache_dtype: str = "auto"
    num_pages: int = 512
    hadamard: bool | None = None
    with_mtp: bool = True
    push: PushTuning = PushTuning()  # the KV link's posting threads, descriptor size, whether it pushes
    page_layout: str = "cross_layer"  # attention.cache.CacheSpec.page_layout
    two_batch_overlap: bool = False
    keep_fp8: bool | None = None  # None: `fp8_weights` follows the backend; tests set it to run fp8 weights on CPU

    def __post_init__(self) -> None:
        torch_dtype(self.dtype)  # a clear error now, not at load

    @property
    def fp8_weights(self) -> bool:
        """Whether an fp8 checkpoint's projections stay fp8 (the ``cuda`` backend's fp8 kernels); the
        ``reference`` backend dequantizes them on load (it is the spec the fp8 kernels are tested against)."""
        return self.backend == "cuda" if self.keep_fp8 is None else self.keep_fp8

    @property
    def use_hadamard(self) -> bool:
        return self.kv_cache_dtype == "fp8" if self.hadamard is None else self.hadamard

    def cache_spec(self, cfg: ModelConfig, num_pages: int | None = None) -> CacheSpec:
        """The cache geometry a rank of this spec allocates for ``cfg``: one MLA
        cache per attention layer (MTP included when loaded) and an indexer cache
        on the layers that compute top-k. ``num_pages`` overrides the spec's (1:
        the bytes of one page id)."""
        n_main = cfg.num_hidden_layers
        n_mtp = cfg.num_nextn_predict_layers if self.with_mtp else 0
        return CacheSpec(
            num_layers=n_main + n_mtp,
            num_pages=self.num_pages if num_pages is None else num_pages,
            kv_lora_rank=cfg.kv_lora_rank,
            rope_dim=cfg.qk_rope_head_dim,
            index_head_dim=cfg.index_head_dim,
            kv_cache_dtype=self.kv_cache_dtype,
            dtype=torch_dtype(self.dtype),
            indexer_layers=tuple(cfg.topk_plan.computes[:n_main]) + (True,) * n_mtp,
            page_layout=self.page_layout,
        )


@dataclass
class RankParts:
    """A built rank: ``model`` (its shard), ``cache`` (its pages), ``runner`` (builds batches, runs the model)."""

    spec: RankSpec
    model: DsaForCausalLM
    cache: PagedKVCache
    runner: ModelRunner

    def open_link(self, worker_id: str, epoch: int | None = None) -> KVLink:
        """Register this rank's caches with a NIXL agent ``worker_id@epoch`` (None: a fresh epoch)."""
        return KVLink.create(worker_id, self.spec.model_dir, self.cache, has_mtp=len(self.model.mtp) > 0,
                             epoch=epoch, push=self.spec.push)


def build_rank(spec: RankSpec, tp: TPContext = SINGLE, device: str | None = None) -> RankParts:
    """Load ``spec``'s model shard for rank ``tp.rank`` and allocate its caches on ``device`` (default ``spec.device``)."""
    device = device or spec.device
    if uses_cache_groups(spec.model_dir):
        return _build_grouped_rank(spec, tp, device)
    model = load_model(spec.model_dir, torch_dtype(spec.dtype), device, tp=tp, hadamard=spec.use_hadamard,
                       with_mtp=spec.with_mtp, fp8_weights=spec.fp8_weights)
    if spec.backend == "cuda":  # same-input projections as one GEMM each; the reference keeps them apart (the spec)
        fuse_projections(model, tp.size)
    if spec.two_batch_overlap:
        if tp.size < 2:
            raise ValueError("two_batch_overlap overlaps tensor-parallel all-reduces: it needs tensor parallel size > 1")
        model.two_batch = TwoBatchOverlap()
    cache = PagedKVCache(spec.cache_spec(model.cfg), device)
    return RankParts(spec, model, cache, ModelRunner(model, cache, get_backend(spec.backend), device))


def uses_cache_groups(model_dir: str) -> bool:
    """Whether the checkpoint's architecture declares cache groups (DeepSeek-V4, `models.registry`)."""
    from models.registry import arch_spec, read_config_json

    return arch_spec(read_config_json(model_dir).get("model_type")).cache_groups is not None


def _build_grouped_rank(spec: RankSpec, tp: TPContext, device: str) -> RankParts:
    """A DeepSeek-V4 rank: the ``models.v4`` model (its MTP layer with ``spec.with_mtp``), its cache groups
    (``spec.num_pages`` pages each) in one ``GroupedPagedCache``, the `workers.v4_runner.V4ModelRunner`.
    One rank; on the cuda backend its sparse attention runs on FlashMLA (`attention.cuda.v4_attention`; decode
    with fp8 caches `attention.cuda.v4_decode`)."""
    from attention.group_cache import GroupedPagedCache
    from models.registry import load_any_model
    from models.v4.cache_spec import v4_formats, v4_group_layouts
    from workers.v4_runner import V4ModelRunner

    limits = {"tensor parallel size": (tp.size, 1), "two_batch_overlap": (spec.two_batch_overlap, False)}
    for what, (got, want) in limits.items():
        if got != want:
            raise ValueError(f"DeepSeek-V4 runs with {what} {want!r} only for now, got {got!r}")
    if spec.backend not in ("reference", "cuda"):
        raise ValueError(f"DeepSeek-V4 runs on the reference or the cuda backend, got {spec.backend!r}")
    model = load_any_model(spec.model_dir, dtype=torch_dtype(spec.dtype), device=device, with_mtp=spec.with_mtp)
    if spec.backend == "cuda":  # sparse attention on FlashMLA; the rest of V4 as torch ops on the device
        from attention.cuda.v4_attention import check_v4_dims, sparse_attention_with_sink

        check_v4_dims(model.cfg.head_dim, model.cfg.num_attention_heads)
        model.set_attention_kernel(sparse_attention_with_sink)
        if spec.kv_cache_dtype == "fp8":  # decode reads the V4 fp8 pages in place (bf16 pages: no kernel)
            from attention.cuda.v4_decode import new_meta, v4_sparse_decode

            model.set_decode_kernel(v4_sparse_decode, new_meta)
    # fp8 caches: the model rounds keys, entries and indexer keys through the pages' formats as it makes them.
    model.set_kv_cache_format(*v4_formats(model.cfg, spec.kv_cache_dtype))
    # The MTP layer's keys (when loaded) are one more layer of the swa group.
    layouts = v4_group_layouts(model.cfg, torch_dtype(spec.dtype), spec.kv_cache_dtype, with_mtp=len(model.mtp) > 0)
    cache = GroupedPagedCache(layouts, {lay.name: spec.num_pages for lay in layouts}, device,
                              page_kernels=spec.backend == "cuda")
    return RankParts(spec, model, cache, V4ModelRunner(model, cache, device))
