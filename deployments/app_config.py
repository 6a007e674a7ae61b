"""Typed arguments of the Ray Serve application (``deployments.app:build_app``).

Every serve config in ``configs/`` names ``import_path:
deployments.app:build_app`` and passes an ``args`` mapping; that mapping is
an :class:`AppConfig`. Serve validates typed builder arguments itself, and
``dsa-pd check CONFIG.yaml`` validates the same models offline, so a typo or
an out-of-range value is reported with its path (``decode.num_pages``)
before anything is placed on a GPU.

These models hold only what can be checked field by field; rules that relate
fields to each other or to the checkpoint (tensor-parallel divisibility,
memory budget, prefill/decode agreement, feature conflicts) live in
:mod:`deployments.controller`, which reports all of them at once.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from models.dtypes import DtypeName
from workers.push_tuning import DEFAULT_DESCRIPTOR_PAGES, PushTuning
from workers.rank_build import RankSpec

__all__ = [
    "APP_IMPORT_PATH",
    "AppConfig",
    "Autoscaling",
    "ChatConfig",
    "Features",
    "LimitsConfig",
    "ModelSource",
    "RoleConfig",
    "RouterConfig",
    "ServingMode",
    "TinyModelSpec",
    "TransferConfig",
    "default_cache_dir",
]

APP_IMPORT_PATH = "deployments.app:build_app"
"""The ``import_path`` every serve config of this project uses."""

RouterPolicy = Literal["cache_aware", "least_loaded", "round_robin"]
ServingMode = Literal["pd", "monolithic"]


def default_cache_dir() -> Path:
    """Where tiny models are made: ``$DSA_PD_CACHE`` or ``~/.cache/dsa-pd`` (as ``dsa-pd generate --tiny``)."""
    return Path(os.environ.get("DSA_PD_CACHE", Path.home() / ".cache" / "dsa-pd"))


class _Strict(BaseModel):
    # extra="forbid": a misspelt key is an error naming its path instead of a
    # silently ignored setting. Frozen: the validated config is shared by the
    # controller, the placement plan and every replica, and must not drift.
    model_config = ConfigDict(extra="forbid", frozen=True)


# The attention dims of the real models (and of the only shapes FlashMLA and
# DeepGEMM run): a tiny model with these runs on the cuda backend.
SERVING_ATTENTION_DIMS = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128, "index_n_heads": 64}
# DeepSeek-V4's: one 512-wide key = value head (64 rope channels), 64 query heads (FlashMLA's d_qk 512), its
# indexer's 64 x 128.
SERVING_ATTENTION_DIMS_V4 = {"head_dim": 512, "num_attention_heads": 64, "partial_rotary_factor": 0.125,
                            "index_head_dim": 128, "index_n_heads": 64}


class TinyModelSpec(_Strict):
    """A tiny random checkpoint (``models.tiny.make_tiny``), made on first start into the cache dir."""

    arch: Literal["deepseek_v32", "glm_moe_dsa", "deepseek_v4"] = Field(
        description="Architecture of the tiny model (deepseek_v4: models/tiny_v4.py; bf16, byte tokenizer).")
    seed: int = Field(0, ge=0, description="Weights are a function of the seed only.")
    fp8: bool = Field(False, description="Store weights block-quantized fp8 (128x128), as the real releases.")
    tokenizer: Literal["byte", "native"] = Field(
        "byte",
        description="'byte': the tiny byte-level tokenizer with made-up special tokens and a toy chat template; "
        "'native': the family's real special tokens and chat format (DeepSeek-V3.2: no chat template, served "
        "through its native encoder; GLM-5: its Jinja template), see models/tiny_native.py.",
    )
    attention: Literal["tiny", "serving"] = Field(
        "tiny",
        description="Attention dims: 'tiny' (small, CPU), or 'serving' — the real models' 512 latent + 64 rope "
        "and 64 x 128 indexer (DeepSeek-V4: 64 heads of one 512-wide key = value head), which the cuda "
        "backend's FlashMLA / DeepGEMM kernels require.",
    )

    @property
    def overrides(self) -> dict[str, Any]:
        """``make_tiny`` overrides for the attention dims."""
        if self.attention != "serving":
            return {}
        return dict(SERVING_ATTENTION_DIMS_V4 if self.arch == "deepseek_v4" else SERVING_ATTENTION_DIMS)

    @property
    def dir_name(self) -> str:
        """Directory name in the cache; the same one ``dsa-pd generate --tiny`` uses, so the cache is shared."""
        suffix = ("-fp8" if self.fp8 else "") + ("-serving" if self.attention == "serving" else "") \
            + ("-native" if self.tokenizer == "native" else "")
        return f"tiny-{self.arch}-s{self.seed}{suffix}"

    def config_dict(self) -> dict[str, Any]:
        """The ``config.json`` contents ``make_tiny`` writes, without making the checkpoint.

        Lets ``dsa-pd check`` validate a tiny config on a machine where the
        model was never made (tests compare this with a made checkpoint).
        """
        from models.tiny import tiny_config_kwargs
        from models.weights import FP8_QUANTIZATION_CONFIG

        raw = dict(tiny_config_kwargs(self.arch, **self.overrides), model_type=self.arch)
        if self.fp8:
            raw["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
        return raw


class ModelSource(_Strict):
    """Where the weights come from: a checkpoint directory or a tiny-model spec (exactly one).

    ``config`` is an inline copy of the checkpoint's ``config.json``. It lets
    real-scale configs (DeepSeek-V3.2, GLM-5) be validated on a machine that
    does not hold the checkpoint; where ``path/config.json`` exists it is the
    truth and the controller reports any field on which the copy disagrees.
    """

    path: str | None = Field(None, description="Hugging Face checkpoint directory (config.json, safetensors).")
    tiny: TinyModelSpec | None = Field(None, description="Make a tiny random checkpoint instead of loading one.")
    cache_dir: str | None = Field(
        None, description="Where tiny models are made; default $DSA_PD_CACHE or ~/.cache/dsa-pd."
    )
    config: dict[str, Any] | None = Field(
        None, description="Inline copy of config.json, for validating a checkpoint that is not on this machine."
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + completion served; default the model's max_position_embeddings."
    )

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSource":
        if (self.path is None) == (self.tiny is None):
            raise ValueError("give exactly one of model.path (a checkpoint) or model.tiny (a tiny-model spec)")
        if self.tiny is not None and self.config is not None:
            # A tiny model's config is known from its spec; a second copy could only disagree.
            raise ValueError("model.config mirrors a checkpoint's config.json; it cannot be given with model.tiny")
        return self

    def checkpoint_dir(self, make: bool = False) -> Path:
        """The checkpoint directory; for a tiny spec, made into the cache dir when ``make`` and missing.

        Making is atomic (a temporary directory renamed into place): the
        prefill and decode replicas of one node start at the same time and
        must never load a half-written checkpoint, nor fail because the other
        one finished first.
        """
        if self.path is not None:
            path = Path(self.path).expanduser()
            if not path.is_absolute() and not path.exists():
                # A shipped config's relative path (models/checkpoints/...) names a directory of
                # the checkout, wherever Ray starts the replica's process.
                in_checkout = Path(__file__).resolve().parents[1] / path
                if in_checkout.exists():
                    return in_checkout
            return path
        assert self.tiny is not None
        cache = Path(self.cache_dir) if self.cache_dir else default_cache_dir()
        out = cache / self.tiny.dir_name
        if not make or (out / "config.json").exists():
            return out
        from models.tiny import make_tiny

        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".{self.tiny.dir_name}.{uuid.uuid4().hex}"
        try:
            make_tiny(self.tiny.arch, tmp, seed=self.tiny.seed, fp8=self.tiny.fp8, tokenizer=self.tiny.tokenizer,
                      **self.tiny.overrides)
            try:
                os.rename(tmp, out)
            except OSError:
                # Another replica renamed its copy first; theirs is identical (same seed).
                if not (out / "config.json").exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return out

    @property
    def default_served_name(self) -> str:
        if self.tiny is not None:
            return f"tiny-{self.tiny.arch}"
        return Path(str(self.path)).name or str(self.path)


class Autoscaling(_Strict):
    """Serve autoscaling bounds of a role (replaces ``num_replicas``)."""

    min_replicas: int = Field(
        1, ge=1, description="At least 1: a cold replica loads its weights for minutes, so no scale-to-zero."
    )
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float | None = Field(
        None, gt=0, description="Requests per replica Serve aims for; default the role's max_batch_size."
    )

    @model_validator(mode="after")
    def _bounds(self) -> "Autoscaling":
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) must be <= max_replicas ({self.max_replicas})"
            )
        return self


class RoleConfig(_Strict):
    """The replicas of one role (prefill or decode) and the engine settings of each replica.

    A replica is one Serve replica that owns ``tensor_parallel_size`` rank
    workers; with one rank the worker runs in-process. In monolithic mode
    (``AppConfig.mode``) the decode section is the only one and its replicas
    prefill their own requests. ``num_gpus`` is per
    replica: a fraction (e.g. 0.5) lets both roles share one GPU for the
    single-GPU demo; with tensor parallelism it must equal the rank count.
    """

    num_replicas: int | None = Field(None, ge=1, description="Fixed replica count (default 1); or use autoscaling.")
    autoscaling: Autoscaling | None = Field(None, description="Autoscaling bounds instead of num_replicas.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica; fractions allowed with one rank.")
    num_cpus: float = Field(1.0, ge=0, description="CPUs per rank worker (per replica when it has one rank).")
    tensor_parallel_size: int = Field(1, ge=1, description="Ranks (GPUs) per replica.")
    gpus_per_node: int = Field(8, ge=1, description="GPUs of one node; a replica's ranks are packed on one node.")
    gpu_memory_gib: float = Field(80.0, gt=0, description="Memory of one GPU (80 for H100, 139 for H200).")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of GPU memory the replica may plan with (the rest: CUDA context, NCCL)."
    )
    workspace_gib: float = Field(2.0, ge=0, description="Allowance for activations and kernel workspaces per rank.")
    backend: Literal["reference", "cuda"] = Field(
        "reference", description="Attention backend: 'reference' (pure torch) or 'cuda' (flash_mla, deep_gemm)."
    )
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: DtypeName = Field("float32", description="Weights and activations dtype.")
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto", description="'fp8': serving byte formats (656-byte MLA, 132-byte indexer tokens); 'auto': dtype."
    )
    page_size: int = Field(64, ge=1, description="Tokens per cache page; the DSA byte formats fix it at 64.")
    page_layout: Literal["cross_layer", "per_layer"] = Field(
        "cross_layer",
        description="Where a page id's bytes of different layers live: 'cross_layer' (one buffer, a page holds "
        "every layer's MLA + indexer bytes, so a run of pages is one transfer descriptor) or 'per_layer' (a "
        "buffer per layer: one descriptor per layer and run). Prefill and decode must agree (docs/perf.md).",
    )
    chunk_size: int = Field(
        4096, ge=1, description="Prefill tokens per forward chunk (prefill role: pages are pushed per chunk; decode "
        "role: the engine's prefill budget per step, for prompts in monolithic mode and re-prefills after preemption)."
    )
    num_pages: int = Field(512, ge=1, description="Page pool size per rank (every layer's caches share page ids).")
    mtp_draft_tokens: int = Field(
        0,
        ge=0,
        le=3,  # DeepGEMM's paged indexer runs next_n = draft + 1 <= 4 (DESIGN.md)
        description="MTP draft tokens per decode step (0 = no MTP). On prefill, > 0 runs the MTP layer so its "
        "cache pages are filled for decode; prefill and decode must agree on whether MTP is on.",
    )
    max_batch_size: int = Field(32, ge=1, description="Most requests in one forward.")
    cuda_graphs: bool | None = Field(
        None,
        description="Decode steps from one captured CUDA graph per batch-size bucket (decode role; with "
        "tensor_parallel_size > 1 every rank captures its own), and short prefills of one prompt per token bucket "
        "(both roles, one rank: prefill_graph_max_tokens). Default: on for backend 'cuda' on a GPU, except "
        "tensor parallel with MTP drafts; True elsewhere is an error.",
    )
    overlap_scheduling: bool = Field(
        True, description="Decode role: launch a pure-decode step before reading the previous one back, so the "
        "host's per-step work (stop checks, streaming, scheduling) runs while the device computes "
        "(workers.engine.Engine.step). Steps with prefill chunks, MTP or penalties read back at once.",
    )
    stream_items_per_s: float = Field(
        2000.0, ge=0, description="Decode role: the replica's budget of streamed items per second. Each request "
        "sends its new tokens at most every (running streams / this) seconds (capped at 0.1 s), merging what "
        "the engine produced meanwhile: per-item costs in Serve, the ingress and the proxy stay bounded at high "
        "concurrency. TPOT is unchanged; ITL rises to that interval. 0: send every step's tokens at once "
        "(deployments.stream_pacing).",
    )
    engine_process: bool | None = Field(
        None, description="Run the role's worker (engine, page pool, NIXL agent) in a child process of each "
        "replica, so that its loop does not share the Python interpreter (GIL) with Serve's request handling and "
        "streaming, as vLLM and SGLang run theirs (deployments/engine_process.py). Default: on for backend "
        "'cuda' at tensor_parallel_size 1 (served on an H200: 1.6x the output tokens/s of the engine thread at "
        "32 streams, 1.7x at 128; docs/perf.md, session 22), off elsewhere; true with tensor_parallel_size > 1 is "
        "an error.",
    )
    gil_switch_interval_ms: float = Field(
        0.2, gt=0, le=100, description="Python's thread switch interval in this role's replicas (sys.setswitchinterval; "
        "Python's default is 5 ms). The engine thread shares the replica's interpreter with Serve's event loops "
        "(streaming, metrics); each time it gets the GIL back after a device wait it can queue behind them for up to "
        "this long, once per wait, several times a step (docs/perf.md, \"The engine thread and the GIL\").",
    )
    cuda_graph_max_context: int | None = Field(
        None, ge=64, description="Longest context a captured decode step, or a captured prefill over a cached "
        "prefix, serves (longer ones run eagerly); default: what the page pool holds for one request, capped by "
        "the model's max positions and model.max_model_len.",
    )
    prefill_graph_max_tokens: int | None = Field(
        None, ge=0, description="With cuda_graphs on (either role): a prefill of one new prompt of up to this many "
        "tokens, or of up to 32 requests' new tokens, min(this, 512) in all (fewer past 32k-token contexts), over "
        "any cached prefixes (prefix-cache hits, last chunks, short prompts together) in contexts up to "
        "cuda_graph_max_context, pads to a token bucket (16, 32, 64, 128, then every 128) and replays that bucket's "
        "captured CUDA graph instead of launching every kernel from the host (workers/prefill_graphs.py). Default "
        "(null): 1024, capped by the model's index_topk and chunk_size; 0: off. Larger prefills run eagerly. Not built for tensor_parallel_size > 1 or DeepSeek-V4 (a value > 0 "
        "there is an error).",
    )
    max_ongoing_requests: int | None = Field(
        None, ge=1, description="Serve's per-replica request cap; default 2 x max_batch_size (one batch queued)."
    )

    @model_validator(mode="after")
    def _replicas(self) -> "RoleConfig":
        if self.num_replicas is not None and self.autoscaling is not None:
            raise ValueError("give num_replicas or autoscaling, not both")
        return self

    @property
    def runs_engine_process(self) -> bool:
        """``engine_process`` resolved: an explicit value, else on for the cuda backend at one rank."""
        if self.engine_process is not None:
            return self.engine_process
        return self.backend == "cuda" and self.tensor_parallel_size == 1

    @property
    def has_mtp(self) -> bool:
        """Whether this role loads the MTP layer (and has cache pages for it)."""
        return self.mtp_draft_tokens > 0

    def rank_spec(self, model_dir: str | Path = "", push: PushTuning = PushTuning(),
                  two_batch_overlap: bool = False) -> RankSpec:
        """What each rank of a replica of this role loads. The MTP layer is loaded only where
        drafts use it: the memory plan, the cache geometry and the handshake's has_mtp follow
        ``mtp_draft_tokens``. ``model_dir`` may stay empty for sizing (`RankSpec.cache_spec`).
        ``two_batch_overlap``: ``features.two_batch_overlap`` (`models.two_batch`)."""
        return RankSpec(str(model_dir), self.backend, self.device, self.dtype, self.kv_cache_dtype, self.num_pages,
                        with_mtp=self.has_mtp, push=push, page_layout=self.page_layout,
                        two_batch_overlap=two_batch_overlap)

    @property
    def ongoing_requests_cap(self) -> int:
        return self.max_ongoing_requests or 2 * self.max_batch_size

    @property
    def max_replicas(self) -> int:
        """The most replicas the role runs: autoscaling's ``max_replicas``, else ``num_replicas`` (default 1)."""
        return self.autoscaling.max_replicas if self.autoscaling is not None else (self.num_replicas or 1)


class RouterConfig(_Strict):
    """How the ingress picks a decode replica and the decode replica a prefill replica."""

    policy: RouterPolicy = Field(
        "cache_aware",
        description="'cache_aware' (highest overlap_weight x cached prompt pages - requests in flight: the "
        "replica already holding the prompt's prefix, unless it is that much busier), 'least_loaded' (fewest "
        "requests in flight), 'round_robin' (deployments/router.py).",
    )
    overlap_weight: float = Field(
        0.25, ge=0, description="'cache_aware': requests of load one cached 64-token page of the prompt is worth."
    )
    prefix_pages: int = Field(
        256, ge=1, description="'cache_aware': leading 64-token pages of a prompt looked up in the replicas' "
        "reported cache keys (256: the first 16k tokens).",
    )


class TransferConfig(_Strict):
    """KV page transfer (prefill -> decode over NIXL). Ignored in monolithic mode, which transfers nothing."""

    deadline_s: float = Field(30.0, gt=0, description="A transfer not complete by then is aborted, pages freed.")
    peer_ttl_s: float = Field(
        10.0, gt=0, description="A replica whose heartbeats (twice a second, through the peer directory) stopped "
        "this long is gone for its peers: they forget its NIXL agent and fail its transfers at once, without "
        "waiting for their deadline. Keep it above the longest pause a live replica may take.",
    )
    warmup_at_start: bool = Field(
        True, description="Transfer once between every prefill/decode rank pair at start: a new pair's first "
        "transfer is ~10x slower (DESIGN.md)."
    )
    push_threads: int | None = Field(
        None, ge=0, le=64,
        description="GPU caches only: NIXL posting threads per agent, each on its own UCX worker (a CUDA stream "
        "of its own): a WRITE of two or more descriptors is split over them, one of a single descriptor "
        "(a request on contiguous pages) is posted on the calling thread. None = the link's default "
        "(workers.push_tuning.DEFAULT_PUSH_THREADS); 0 = one thread with UCX scatter-gather offload (the old "
        "setting). Fewer suit small hosts (docs/serving.md).",
    )
    descriptor_pages: int | None = Field(
        DEFAULT_DESCRIPTOR_PAGES, ge=1,
        description="Most pages one transfer descriptor covers; longer page runs are cut, so that one request's "
        "WRITE spreads over the posting threads. None (default) = whole runs: a request on contiguous pages of "
        "a cross_layer cache is one copy, posted without waking a thread (docs/perf.md, session 7).",
    )

    def push_tuning(self) -> PushTuning:
        """The `workers.push_tuning.PushTuning` these settings give."""
        return PushTuning(threads=self.push_threads, descriptor_pages=self.descriptor_pages)


class Features(_Strict):
    """Feature switches; the controller rejects combinations that cannot work."""

    two_batch_overlap: bool = Field(
        False, description="Run each eager forward of a tensor-parallel replica as two micro-batches whose "
        "all-reduces overlap the other's compute, interleaved in one fixed order at their all-reduces "
        "(models/two_batch.py): tensor_parallel_size > 1, not with top-k sharing; CUDA-graphed decode steps "
        "run whole."
    )
    mtp_topk_reuse: bool = Field(
        False, description="Reuse the indexer top-k of the first MTP draft step in later draft steps."
    )
    draft_topk: int = Field(1, ge=1, description="Candidate tokens per MTP draft step (1 = a chain).")
    prefix_caching: bool = Field(
        True, description="Keep finished requests' full 64-token pages (every layer's MLA and indexer pages, the "
        "MTP layer's too) in each replica's page pool, keyed by a hash chain over their tokens, and reuse them "
        "for prompts that start the same: a cached prefix is not prefilled again, and decode replicas tell "
        "prefill how many leading pages they hold, which are not pushed. Unreferenced cached pages count as "
        "free and are evicted least recently used first (workers/prefix_cache.py). The routers rank replicas "
        "by cached prefix against load (deployments/router.py).",
    )


class ChatConfig(_Strict):
    """Server-wide defaults of chat requests; a request's ``chat_template_kwargs`` /
    ``reasoning_effort`` override them (``deployments.openai.render``)."""

    thinking: bool | None = Field(
        None, description="Replies start with the model's reasoning (returned as reasoning_content): true / "
        "false, or None = the chat format's default (DeepSeek-V3.2's native encoder: off; a Jinja template: "
        "its own default, GLM-5's is on).",
    )
    drop_thinking: bool = Field(
        True, description="Leave earlier assistant turns' reasoning_content out of the prompt (the published "
        "formats do).",
    )


class IngressConfig(_Strict):
    """The OpenAI-compatible ingress deployment (``deployments/ingress.py``)."""

    num_replicas: int | None = Field(
        None, ge=1, description="Ingress replicas. Each streamed item passes through the ingress (detokenized, "
        "written as a server-sent event) on its way from a decode replica to Serve's HTTP proxy, and Serve's proxy "
        "spreads requests over the replicas: on an H200, one ingress replica streaming 128 requests used a whole "
        "core and held the output back (8,260 output tok/s; four: 10,689; docs/perf.md, session 23). Default: one "
        "per 32 streams the decode role runs at once (its largest replica count x max_batch_size), 1 to 8 "
        "(deployments.admission.ingress_replicas). Each takes no CPU reservation (num_cpus 0) and about 0.7 GB "
        "of host memory.",
    )


class LimitsConfig(_Strict):
    """What the server accepts before it refuses (deployments/admission.py, deployments/openai/limits.py).

    Overload is answered 429 with ``Retry-After`` (OpenAI's error shape, code
    ``overloaded``), never by queueing without bound: an ingress replica holds
    at most ``max_requests`` requests, and a request that has not started
    (pages reserved at decode, its prefill begun) ``queue_timeout_s`` after it
    reached the ingress is refused wherever it waits.
    """

    max_requests: int | None = Field(
        None, ge=1, description="Requests one ingress replica holds at once (admitted, not yet finished); past it "
        "a request is answered 429 at once. Default: twice what the decode role takes (its largest replica count "
        "x max_ongoing_requests): one decode capacity running, one waiting in Serve's queue, shared out over the "
        "ingress replicas (ingress.num_replicas).",
    )
    queue_timeout_s: float | None = Field(
        None, gt=0, description="Longest a request may wait to start (for a decode replica, for pages, for a "
        "prefill replica), counted from its arrival at the ingress; then 429. Default: half of "
        "transfer.deadline_s in pd mode (the rest is left to the prefill and its push), 60 in monolithic mode.",
    )
    retry_after_s: int = Field(1, ge=0, description="The Retry-After header (seconds) of a 429.")
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Longest request body; a longer one is answered 413 (read no further).",
    )
    max_json_depth: int = Field(
        64, ge=4, le=512, description="Deepest nesting of JSON arrays/objects in a request body (400 past it).",
    )


class AppConfig(_Strict):
    """Everything ``deployments.app:build_app`` takes (the ``args`` of a serve config)."""

    model: ModelSource
    served_model_name: str | None = Field(None, description="The OpenAI `model` name; default from the source.")
    mode: ServingMode = Field(
        "pd",
        description="'pd': disaggregated prefill and decode roles, KV pages pushed over NIXL. 'monolithic': "
        "decode replicas only, each prefilling its own requests with the engine's chunked prefill "
        "(decode.chunk_size, decode.max_batch_size), no NIXL agent: to compare with monolithic servers "
        "(vLLM) or serve from one GPU. Monolithic mode takes no prefill section and ignores transfer.",
    )
    prefill: RoleConfig = Field(
        default_factory=RoleConfig, description="The prefill role (pd mode only; not given in monolithic mode)."
    )
    decode: RoleConfig = Field(
        default_factory=RoleConfig, description="The decode role; in monolithic mode the only one (it prefills too)."
    )
    router: RouterConfig = Field(default_factory=RouterConfig)
    transfer: TransferConfig = Field(
        default_factory=TransferConfig, description="KV transfer settings (pd mode; ignored in monolithic mode)."
    )
    features: Features = Field(default_factory=Features)
    api_key_env: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Name of an environment variable holding an API key. When set, every request but /health must "
        "send `Authorization: Bearer <key>` (401 otherwise), and the ingress does not start while the variable is "
        "unset or empty (deployments/auth.py). The Helm chart sets it from a Secret (auth.enabled).",
    )
    api_key_file: str | None = Field(
        None, description="Path of a file holding the API key (e.g. a mounted Secret), read at ingress start; "
        "surrounding whitespace is stripped. Same effect as api_key_env; give at most one of the two.",
    )
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    chat: ChatConfig = Field(default_factory=ChatConfig, description="Defaults of chat requests.")
    limits: LimitsConfig = Field(
        default_factory=LimitsConfig, description="Request limits and overload answers (429, 413, 400).",
    )

    @model_validator(mode="after")
    def _one_key_source(self) -> "AppConfig":
        if self.api_key_env is not None and self.api_key_file is not None:
            raise ValueError("give api_key_env or api_key_file, not both: which key would be checked?")
        return self

    @property
    def model_name(self) -> str:
        """The name clients pass as ``model``."""
        return self.served_model_name or self.model.default_served_name

    @property
    def monolithic(self) -> bool:
        """Decode replicas prefill locally; no prefill role, no KV transfer."""
        return self.mode == "monolithic"

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles deployed: ``("prefill", "decode")`` in pd mode, ``("decode",)`` in monolithic mode."""
        return ("decode",) if self.monolithic else ("prefill", "decode")

    def for_role(self, role: str) -> RoleConfig:
        """The ``"prefill"`` or ``"decode"`` role."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        return self.prefill if role == "prefill" else self.decode
