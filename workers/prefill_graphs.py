"""Small prefills of one prompt through static per-bucket buffers, replayed as CUDA graphs.

A prefill step of a short prompt costs far more host time than GPU time: on the H200 a
1024-token prefill of the 2-layer benchmark model kept the GPU busy 6.2 of 26.9 ms, the rest
the host launching ~140 kernels a layer (docs/perf.md, session 24). So a PREFILL forward of one
request whose new tokens fit a token bucket replays that bucket's captured graph: one launch.
Two kinds, each its own graphs (`PrefillGraphPlan`):

* **A new prompt** (no cached prefix, at most ``max_tokens`` tokens): the prefill forward itself,
  padded. With no cached prefix every token's causal window is within the bucket, and a bucket is
  never wider than the indexer's top-k (`prefill_graph_tokens` caps it there), so the indexer's
  selection is each token's whole window (`models.indexer.Indexer._whole_windows`), a function of
  the positions alone; the keys the sparse prefill reads are the prompt's own, gathered through its
  page table; the MoE's contiguous layout sizes everything from the token count
  (`models.moe.dispatch`). No shape depends on a value and nothing is read back, so the whole
  forward, attention and indexer included, is one graph (vLLM and SGLang break theirs around those
  calls). A pad token sits at the next positions, reads page 0 (harmless reads) and writes no cache
  entry (slot ``-1``).
* **New tokens over a cached prefix** (a prefix-cache hit; at most ``suffix_rows`` of them, the
  context at most ``max_context``): laid out as a decode step with one row per new token, each row
  the same request's page table and its own context length (its position + 1), run by the decode
  path's kernels (DeepGEMM's paged indexer logits, the radix top-k, FlashMLA's sparse decode over
  the paged fp8 cache), which take variable contexts inside a graph; the MoE takes its masked
  fixed-shape layout (`ForwardBatch.static_shapes`). Every row's KV is written before any row
  attends, so a row sees the new tokens before it as a prefill would. Pad rows are the decode
  graphs' padding rows: position 0, context 1, slot ``-1``.

Real rows equal the unpadded eager prefill up to float rounding (GEMMs over another row count; the
decode kernels instead of the prefill ones for a suffix). ``capture=False`` runs the very same code
eagerly on the same buffers: on CPU (tests) and as the reference the replayed graphs are checked
against, bit for bit (tests/workers/test_prefill_graphs_gpu.py).

Longer prompts and suffixes, several prompts in one step, tensor parallel and DeepSeek-V4 run
eagerly as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from attention.formats import PAGE_SIZE, pages_for_tokens
from models.batch import ForwardBatch, ForwardMode
from workers.decode_graphs import capture_forwards
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


SUFFIX_MAX_ROWS = 512
"""Most new tokens over a cached prefix that a graph serves. Issue 24's shared-prefix load computes
320 of them (a 256-token suffix, and the prefix's last page: a page's key covers the token after it,
`workers.prefix_cache.LOOKAHEAD`, so the page before a new suffix never hits)."""

SUFFIX_LOGITS_BYTES = 64 << 20
"""What the suffix graphs' indexer logits may take (fp32 ``[rows, max_context]``, one buffer in the graph
pool): `suffix_rows` lowers the row cap for long contexts (512 rows at 9,216 positions take 18 MiB;
at 163,840 positions the cap is 96 rows)."""


def suffix_rows(max_tokens: int, max_context: int) -> int:
    """The most new tokens over a cached prefix a graph serves: ``min(max_tokens, SUFFIX_MAX_ROWS)``, lowered
    (to a multiple of 16, at least 16) so their logits fit `SUFFIX_LOGITS_BYTES`."""
    fit = SUFFIX_LOGITS_BYTES // (4 * max(max_context, 1))
    return max(16, min(max_tokens, SUFFIX_MAX_ROWS, fit // 16 * 16))


@dataclass(frozen=True)
class PrefillGraphPlan:
    """Which prefills have a graph: one request, and either a new prompt of at most ``buckets[-1]``
    tokens, or at most ``suffix_buckets[-1]`` new tokens over a cached prefix in a context of at most
    ``max_context`` tokens.

    buckets:        ascending token counts of new prompts, one graph each
    suffix_buckets: ascending token counts over a cached prefix, one graph each (empty: none)
    max_context:    the longest context of a suffix graph (its indexer's logits width)
    """

    buckets: tuple[int, ...]
    suffix_buckets: tuple[int, ...] = ()
    max_context: int = 0

    def __post_init__(self) -> None:
        for name in ("buckets", "suffix_buckets"):
            b = getattr(self, name)
            if (name == "buckets" and not b) or list(b) != sorted(set(b)) or (b and b[0] < 1):
                raise ValueError(f"{name} must be ascending distinct positive ints, got {b}")
        if self.suffix_buckets and self.max_context < PAGE_SIZE:
            raise ValueError(f"suffix graphs need max_context >= {PAGE_SIZE}, got {self.max_context}")

    @classmethod
    def for_limits(cls, max_tokens: int, max_context: int = 0) -> "PrefillGraphPlan":
        """New prompts up to ``max_tokens`` (`prefill_buckets`); with ``max_context`` > 0 also suffixes of
        up to `suffix_rows` tokens in contexts up to ``max_context``."""
        rows = suffix_rows(max_tokens, max_context)
        return cls(prefill_buckets(max_tokens), prefill_buckets(rows) if max_context > 0 else (),
                   max_context if max_context > 0 else 0)

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    @property
    def max_pages(self) -> int:
        """Page-table width of the largest new-prompt bucket."""
        return pages_for_tokens(self.max_tokens)

    @property
    def context_pages(self) -> int:
        """Page-table width of the suffix graphs (``max_context`` tokens)."""
        return pages_for_tokens(self.max_context)

    @staticmethod
    def _bucket(buckets: tuple[int, ...], n: int) -> int | None:
        for b in buckets:
            if b >= n:
                return b
        return None

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest new-prompt bucket holding ``num_tokens`` tokens, or None."""
        return self._bucket(self.buckets, num_tokens)

    def suffix_bucket(self, num_tokens: int) -> int | None:
        """The smallest suffix bucket holding ``num_tokens`` tokens, or None."""
        return self._bucket(self.suffix_buckets, num_tokens)

    def kind(self, items) -> str | None:
        """``"prompt"`` or ``"suffix"``: which graphs serve a PREFILL forward over ``items``
        (`workers.model_runner.WorkItem` s), or None (it runs eagerly)."""
        if len(items) != 1 or not isinstance(items[0].page_table, tuple):
            return None
        it = items[0]
        n = len(it.token_ids)
        if n < 1:
            return None
        if it.start == 0:
            return "prompt" if n <= self.max_tokens else None
        if self.suffix_buckets and n <= self.suffix_buckets[-1] and it.end <= self.max_context:
            return "suffix"
        return None

    def covers(self, items) -> bool:
        return self.kind(items) is not None


class PromptInputs:
    """A new prompt's inputs, on the device, sized for the largest bucket ``T``.

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
        if n > T or len(page_table) < pages_for_tokens(n):
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
        table = p[T + 1: T + 1 + pages_for_tokens(bucket)]
        pos = self.positions[:bucket]
        slots = table[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        out_slots = torch.where(pos < p[T], slots, -1)
        lens = self._lens[bucket]
        return ForwardBatch(
            mode=ForwardMode.PREFILL, input_ids=p[:bucket], positions=pos, out_slots=out_slots,
            page_tables=table.to(torch.int32)[None], seq_lens=lens, q_lens=lens, max_seq_len=bucket,
            seq_lens_host=(bucket,), q_lens_host=(bucket,),
        )

    def real(self, full: ForwardBatch, n: int) -> ForwardBatch:
        """The prompt's own rows of ``full`` (views), its lengths on the host and the device."""
        return ForwardBatch(
            mode=ForwardMode.PREFILL, input_ids=full.input_ids[:n], positions=full.positions[:n],
            out_slots=full.out_slots[:n], page_tables=full.page_tables, seq_lens=self.length, q_lens=self.length,
            max_seq_len=n, seq_lens_host=(n,), q_lens_host=(n,),
        )


class SuffixInputs:
    """New tokens over a cached prefix, laid out as a decode step of one row per token, on the device,
    sized for the largest suffix bucket ``B``.

    ``packed`` int64 ``[B + 3 + P]``: the new tokens (pads 0), the prefix length ``start``, the new
    token count ``n``, the context after them ``start + n``, the request's page ids (``P`` =
    `PrefillGraphPlan.context_pages`, unused entries 0); one host-to-device copy a step.
    """

    def __init__(self, plan: PrefillGraphPlan, device: torch.device):
        self.plan, self.device = plan, device
        B, P = plan.suffix_buckets[-1], plan.context_pages
        self.rows_max = B
        self.packed = torch.zeros(B + 3 + P, dtype=torch.int64, device=device)
        self.rows = torch.arange(B, dtype=torch.int64, device=device)
        self.q_lens = torch.ones(B, dtype=torch.int64, device=device)

    def write(self, tokens: tuple[int, ...], start: int, page_table: tuple[int, ...]) -> None:
        """``len(tokens)`` new tokens at positions ``start ..`` held in ``page_table``, or none
        (``tokens`` empty: every row is a pad)."""
        B, P = self.rows_max, self.plan.context_pages
        n = len(tokens)
        end = start + n
        if n > B or end > self.plan.max_context or len(page_table) < pages_for_tokens(end):
            raise ValueError(f"{n} new tokens after {start} cached in {len(page_table)} pages are outside this plan "
                             f"({B} tokens, contexts up to {self.plan.max_context})")
        pages = list(page_table[:P])
        host = list(tokens) + [0] * (B - n) + [start, n, end] + pages + [0] * (P - len(pages))
        self.packed.copy_(to_device(torch.tensor(host, dtype=torch.int64), self.device))

    def batch(self, bucket: int) -> ForwardBatch:
        """The DECODE forward of ``bucket`` rows: row ``i < n`` is the token at ``start + i`` with context
        ``start + i + 1``; the rest are padding rows (position 0, context 1, slot ``-1``)."""
        B, P = self.rows_max, self.plan.context_pages
        p = self.packed
        start, n = p[B], p[B + 1]
        table = p[B + 3: B + 3 + P]
        live = self.rows[:bucket] < n
        pos = torch.where(live, start + self.rows[:bucket], 0)
        slots = table[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=p[:bucket], positions=pos, out_slots=torch.where(live, slots, -1),
            page_tables=table.to(torch.int32)[None].expand(bucket, P).contiguous(), seq_lens=pos + 1,
            q_lens=self.q_lens[:bucket], max_seq_len=self.plan.max_context, static_shapes=True,
        )

    def real(self, full: ForwardBatch, start: int, n: int) -> ForwardBatch:
        """The suffix's PREFILL description (what callers read: the rows, lengths on the host and the
        device), from the bucket's views."""
        B = self.rows_max
        return ForwardBatch(
            mode=ForwardMode.PREFILL, input_ids=full.input_ids[:n], positions=full.positions[:n],
            out_slots=full.out_slots[:n], page_tables=full.page_tables[:1], seq_lens=self.packed[B + 2: B + 3],
            q_lens=self.packed[B + 1: B + 2], max_seq_len=start + n, seq_lens_host=(start + n,), q_lens_host=(n,),
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
        self.inputs = PromptInputs(plan, self.device)
        self.suffix_inputs = SuffixInputs(plan, self.device) if plan.suffix_buckets else None
        # kind -> bucket -> (graph, its batch, its hidden output)
        self.graphs: dict[str, dict[int, tuple]] = {"prompt": {}, "suffix": {}}
        self.replays = 0

    def covers(self, items) -> bool:
        return self.plan.covers(items)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """One graph per bucket of each kind (`workers.decode_graphs.capture_forwards`), on all-pad inputs."""
        if not self.capture:
            return
        self.inputs.write((), ())
        self.graphs["prompt"] = capture_forwards(self.model, self.cache, self.backend, self.device,
                                                 self.plan.buckets, self.inputs.batch)
        if self.suffix_inputs is not None:
            self.suffix_inputs.write((), 0, ())
            self.graphs["suffix"] = capture_forwards(self.model, self.cache, self.backend, self.device,
                                                     self.plan.suffix_buckets, self.suffix_inputs.batch)

    @torch.inference_mode()
    def run(self, items) -> tuple[ForwardBatch, torch.Tensor]:
        """The PREFILL forward over ``items`` (one prompt's ``n`` new tokens, `covers`): (its batch,
        normed hidden ``[n, hidden]``). The hidden states are a view of the graph's output buffer,
        valid until the next prefill through these graphs (clone to keep); the batch's tensors are
        views of the bucket's buffers (the prompt's rows), its lengths on the host."""
        kind = self.plan.kind(items)
        if kind is None:
            raise ValueError(f"a prefill of {[len(it.token_ids) for it in items]} tokens starting at "
                             f"{[it.start for it in items]} is outside this plan (one prompt: new, up to "
                             f"{self.plan.max_tokens} tokens; over a cached prefix, up to "
                             f"{self.plan.suffix_buckets[-1] if self.plan.suffix_buckets else 0} tokens)")
        it = items[0]
        n = len(it.token_ids)
        if kind == "prompt":
            bucket = self.plan.bucket(n)
            self.inputs.write(it.token_ids, it.page_table)
            make = self.inputs.batch
        else:
            bucket = self.plan.suffix_bucket(n)
            self.suffix_inputs.write(it.token_ids, it.start, it.page_table)
            make = self.suffix_inputs.batch
        if self.capture:
            graph, full, hidden = self.graphs[kind][bucket]
            graph.replay()
            self.replays += 1
        else:
            full = make(bucket)
            hidden = self.model(full, self.cache, self.backend)
        batch = self.inputs.real(full, n) if kind == "prompt" else self.suffix_inputs.real(full, it.start, n)
        return batch, hidden[:n]
