"""Small prefills of one new prompt through static per-bucket buffers, replayed as CUDA graphs.

A prefill step of a short prompt costs far more host time than GPU time: on the H200 a
1024-token prefill of the 2-layer benchmark model kept the GPU busy 6.2 of 26.9 ms, the rest
the host launching ~140 kernels a layer (docs/perf.md, session 24). So a PREFILL forward of one
request with no cached prefix and at most `PrefillGraphPlan.max_tokens` tokens is padded to the
smallest token bucket that holds it and replayed from that bucket's captured graph: one launch.

Why the whole forward can be one graph (where vLLM and SGLang break theirs around the attention
and indexer calls): with no cached prefix, every token's causal window is within the bucket, and
a bucket is never wider than the indexer's top-k (`prefill_graph_tokens` caps it there), so the
indexer's selection is each token's whole window (`models.indexer.Indexer._whole_windows`), a
function of the positions alone; the keys the sparse prefill reads are the prompt's own, gathered
through its page table; the MoE's contiguous layout sizes everything from the token count
(`models.moe.dispatch`). No shape depends on a value and nothing is read back.

The bucket's forward is the prompt's forward plus pad tokens after it: a pad token sits at the
next positions, reads page 0 (harmless reads) and writes no cache entry (slot ``-1``: the cuda
backend's writes skip it, like the decode graphs' padding rows). Causal windows keep every real
token blind to the pads, so the real rows are the unpadded prompt's, up to the rounding of GEMMs
of another row count. ``capture=False`` runs the very same code eagerly on the same buffers: on
CPU (tests) and as the reference the replayed graphs are checked against, bit for bit
(tests/workers/test_prefill_graphs_gpu.py).

Longer prompts, prompts over a cached prefix (a prefix-cache hit, a later chunk), batched prompts,
tensor parallel and DeepSeek-V4 run eagerly as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from attention.formats import PAGE_SIZE, pages_for_tokens
from models.batch import ForwardBatch, ForwardMode
from workers.host_copy import to_device

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 1024
"""`prefill_graph_tokens`' cap when the setting is left unset: vLLM captures up to 512 tokens by
default, SGLang up to 2,048 for MLA models; DeepSeek-V3.2's top-k (2,048) allows up to that."""


def prefill_buckets(max_tokens: int) -> tuple[int, ...]:
    """Token buckets up to ``max_tokens``: 16, 32, 64, 128, then every 128, and ``max_tokens``
    itself (a prompt pads to the smallest that holds it: at most 127 pad tokens past 128)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes = {b for b in (16, 32, 64) if b < max_tokens}
    sizes.update(range(128, max_tokens, 128))
    sizes.add(max_tokens)
    return tuple(sorted(sizes))


def prefill_graph_tokens(setting: int | None, graphs: bool, cfg, chunk_size: int, tp_size: int = 1,
                         cache_groups: bool = False) -> int:
    """The longest prompt a captured prefill serves, 0 for none.

    ``setting``: the role's ``prefill_graph_max_tokens`` (None: `DEFAULT_MAX_TOKENS`, 0: off);
    ``graphs``: whether the role captures CUDA graphs (`workers.decode_graphs.graphs_wanted`).
    Capped by the model's ``index_topk`` (a wider window would need the indexer's scores), the
    prefill chunk (a longer prompt arrives in chunks, all but the first over a cached prefix) and
    the model's positions. Off with tensor parallelism (each rank would capture its own: not built
    yet) and for DeepSeek-V4 (``cache_groups``: its runner is eager): left unset, off there; asked
    for, a ValueError naming the setting."""
    if setting is not None and setting < 0:
        raise ValueError(f"prefill_graph_max_tokens must be >= 0, got {setting}")
    if setting:  # asked for: refuse what would silently capture nothing
        if not graphs:
            raise ValueError(f"prefill_graph_max_tokens={setting} needs CUDA graphs on (cuda_graphs: backend 'cuda' "
                             "on a GPU); set it to 0 or leave it unset")
        if tp_size > 1:
            raise ValueError(f"prefill_graph_max_tokens={setting}: prefill graphs are not built for tensor parallel "
                             f"(tensor_parallel_size {tp_size}); set it to 0 or leave it unset")
        if cache_groups:
            raise ValueError(f"prefill_graph_max_tokens={setting}: prefill graphs are not built for DeepSeek-V4 "
                             "(its runner is eager); set it to 0 or leave it unset")
    if not graphs or tp_size > 1 or cache_groups or setting == 0:
        return 0
    want = DEFAULT_MAX_TOKENS if setting is None else setting
    return max(0, min(want, int(cfg.index_topk), int(chunk_size), int(cfg.max_position_embeddings)))


@dataclass(frozen=True)
class PrefillGraphPlan:
    """Which prefills have a graph: one request, no cached prefix, at most ``buckets[-1]`` tokens.

    buckets: ascending token counts, one graph each
    """

    buckets: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1:
            raise ValueError(f"buckets must be ascending distinct positive ints, got {self.buckets}")

    @classmethod
    def for_limits(cls, max_tokens: int) -> "PrefillGraphPlan":
        return cls(prefill_buckets(max_tokens))

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    @property
    def max_pages(self) -> int:
        """Page-table width of the largest bucket."""
        return pages_for_tokens(self.max_tokens)

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest bucket holding ``num_tokens`` tokens, or None."""
        for b in self.buckets:
            if b >= num_tokens:
                return b
        return None

    def covers(self, items) -> bool:
        """Whether a PREFILL forward over ``items`` (`workers.model_runner.WorkItem` s) runs here."""
        if len(items) != 1:
            return False
        it = items[0]
        return it.start == 0 and isinstance(it.page_table, tuple) and 1 <= len(it.token_ids) <= self.max_tokens


class PrefillInputs:
    """The captured prefills' inputs, on the device, sized for the largest bucket ``T``.

    ``packed`` int64 ``[T + 1 + P]``: the prompt's tokens (pad tokens 0), its length ``n``, its
    page ids (``P`` = `PrefillGraphPlan.max_pages`, unused entries 0); one host-to-device copy a
    step. ``positions`` int64 ``[T]``: ``0 .. T - 1`` (no cached prefix), constant.
    """

    def __init__(self, plan: PrefillGraphPlan, device: torch.device):
        self.plan, self.device = plan, device
        T, P = plan.max_tokens, plan.max_pages
        self.packed = torch.zeros(T + 1 + P, dtype=torch.int64, device=device)
        self.positions = torch.arange(T, dtype=torch.int64, device=device)
        # Each bucket's context length (= its token count), as the batch's seq_lens / q_lens views.
        self._lens = {b: torch.full((1,), b, dtype=torch.int64, device=device) for b in plan.buckets}

    @property
    def length(self) -> torch.Tensor:
        """int64 ``[1]``: the written prompt's length (a view of ``packed``)."""
        T = self.plan.max_tokens
        return self.packed[T: T + 1]

    def write(self, tokens: tuple[int, ...], page_table: tuple[int, ...]) -> None:
        """One prompt of ``len(tokens)`` tokens (at most ``T``) held in ``page_table`` (its first
        `pages_for_tokens` pages are read), or none (``tokens`` empty: every row is a pad)."""
        T, P = self.plan.max_tokens, self.plan.max_pages
        n = len(tokens)
        need = pages_for_tokens(n)
        if n > T or len(page_table) < need:
            raise ValueError(f"a prompt of {n} tokens in {len(page_table)} pages is outside this plan "
                             f"({T} tokens)")
        pages = list(page_table[:P])
        host = list(tokens) + [0] * (T - n) + [n] + pages + [0] * (P - len(pages))
        self.packed.copy_(to_device(torch.tensor(host, dtype=torch.int64), self.device))

    def batch(self, bucket: int) -> ForwardBatch:
        """The PREFILL forward over the first ``bucket`` rows. Cache slots are computed here from the
        buffers, so under capture they are part of the graph: rows at or past the prompt's length are
        pads, slot ``-1``."""
        T = self.plan.max_tokens
        p = self.packed
        pages = pages_for_tokens(bucket)
        table = p[T + 1: T + 1 + pages]
        pos = self.positions[:bucket]
        slots = table[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        out_slots = torch.where(pos < p[T], slots, -1)
        lens = self._lens[bucket]
        return ForwardBatch(
            mode=ForwardMode.PREFILL, input_ids=p[:bucket], positions=pos, out_slots=out_slots,
            page_tables=table.to(torch.int32)[None], seq_lens=lens, q_lens=lens, max_seq_len=bucket,
            seq_lens_host=(bucket,), q_lens_host=(bucket,),
        )


class PrefillGraphs:
    """Runs the target model's covered PREFILL forwards through static buffers, as captured CUDA
    graphs (``capture=True``) or eagerly (``capture=False``, the same code)."""

    def __init__(self, model, cache, backend, plan: PrefillGraphPlan, device: str | torch.device, capture: bool):
        self.model, self.cache, self.backend, self.plan = model, cache, backend, plan
        self.device = torch.device(device)
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        self.capture = capture
        self.inputs = PrefillInputs(plan, self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.batches: dict[int, ForwardBatch] = {}
        self.replays = 0

    def covers(self, items) -> bool:
        return self.plan.covers(items)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """One graph per bucket, largest first, in one memory pool. Each bucket first runs eagerly
        twice with every row a pad (nothing is written to the cache): that compiles the Triton and
        DeepGEMM kernels of its shapes outside the capture."""
        if not self.capture:
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        self.inputs.write((), ())
        for bucket in sorted(self.plan.buckets, reverse=True):
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.model(self.inputs.batch(bucket), self.cache, self.backend)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                batch = self.inputs.batch(bucket)  # inside: its slots are graph kernels
                self.outputs[bucket] = self.model(batch, self.cache, self.backend)
            self.graphs[bucket], self.batches[bucket] = graph, batch
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def run(self, items) -> tuple[ForwardBatch, torch.Tensor]:
        """The PREFILL forward over ``items`` (one prompt of ``n`` tokens from position 0, `covers`):
        (its batch, normed hidden ``[n, hidden]``). The hidden states are a view of the graph's
        output buffer, valid until the next prefill through these graphs (clone to keep); the batch's
        tensors are views of the bucket's buffers (the prompt's rows), its lengths on the host."""
        if not self.covers(items):
            raise ValueError(f"a prefill of {[len(it.token_ids) for it in items]} tokens starting at "
                             f"{[it.start for it in items]} is outside this plan ({self.plan.max_tokens} tokens, "
                             f"one prompt from position 0)")
        it = items[0]
        n = len(it.token_ids)
        bucket = self.plan.bucket(n)
        self.inputs.write(it.token_ids, it.page_table)
        if self.capture:
            self.graphs[bucket].replay()
            self.replays += 1
            hidden, full = self.outputs[bucket], self.batches[bucket]
        else:
            full = self.inputs.batch(bucket)
            hidden = self.model(full, self.cache, self.backend)
        length = self.inputs.length  # n, on the device already
        batch = ForwardBatch(
            mode=ForwardMode.PREFILL, input_ids=full.input_ids[:n], positions=full.positions[:n],
            out_slots=full.out_slots[:n], page_tables=full.page_tables, seq_lens=length, q_lens=length,
            max_seq_len=n, seq_lens_host=(n,), q_lens_host=(n,),
        )
        return batch, hidden[:n]
