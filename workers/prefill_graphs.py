"""Small prefills through static per-bucket buffers, replayed as CUDA graphs.

A prefill step of a short prompt costs far more host time than GPU time: on the H200 a
1024-token prefill of the 2-layer benchmark model kept the GPU busy 6.2 of 26.9 ms, the rest
the host launching ~140 kernels a layer (docs/perf.md, session 24). So a PREFILL forward whose new
tokens fit a token bucket replays that bucket's captured graph: one launch.
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
* **Rows** (up to `ROW_MAX_REQUESTS` requests' new tokens, `row_cap` in all, each over any cached prefix
  -- a prefix-cache hit, a long prompt's last chunk, several short prompts arriving together -- in
  contexts of at most ``max_context``): laid out as a decode step with one row per new token, each row
  its request's page table and its own context length (its position + 1), run by the decode path's
  kernels (DeepGEMM's paged indexer logits, the radix top-k, FlashMLA's sparse decode over the paged
  fp8 cache), which take variable contexts inside a graph; the MoE takes its masked fixed-shape layout
  (`ForwardBatch.static_shapes`). Every row's KV is written before any row attends, so a row sees the
  new tokens before it as a prefill would. Pad rows are the decode graphs' padding rows: position 0,
  context 1, slot ``-1``.

Real rows equal the unpadded eager prefill up to float rounding (GEMMs over another row count; the
decode kernels instead of the prefill ones for rows). ``capture=False`` runs the very same code
eagerly on the same buffers: on CPU (tests) and as the reference the replayed graphs are checked
against, bit for bit (tests/workers/test_prefill_graphs_gpu.py).

Larger prefills, tensor parallel and DeepSeek-V4 run eagerly as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from attention.formats import PAGE_SIZE, pages_for_tokens
from models.batch import ForwardBatch, ForwardMode, slots_for_positions
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


ROW_MAX_TOKENS = 512
"""Most new tokens a rows graph serves (`row_cap`). Issue 24's shared-prefix load computes 256 a request
(its suffix), or 320 with MTP on (then a page's key covers the token after it,
`workers.prefix_cache.key_lookahead`, so the prefix's last page misses before a new suffix)."""

ROW_MAX_REQUESTS = 160
"""Most requests in one rows graph step (their page tables are one host-to-device copy): a decode batch of up
to 128 riding along with the new tokens of up to 32 others (`workers.engine.Engine._prefill`)."""

ROW_LOGITS_BYTES = 64 << 20
"""What the rows graphs' indexer logits may take (fp32 ``[rows, max_context]``, one buffer in the graph
pool): `row_cap` lowers the row cap for long contexts (512 rows at 9,216 positions take 18 MiB; at
163,840 positions the cap is 96 rows)."""


def row_cap(max_tokens: int, max_context: int) -> int:
    """The most new tokens a rows graph serves: ``min(max_tokens, ROW_MAX_TOKENS)``, lowered (to a multiple
    of 16, at least 16) so that their logits fit `ROW_LOGITS_BYTES`."""
    fit = ROW_LOGITS_BYTES // (4 * max(max_context, 1))
    return max(16, min(max_tokens, ROW_MAX_TOKENS, fit // 16 * 16))


@dataclass(frozen=True)
class PrefillGraphPlan:
    """Which prefills have a graph: one new prompt of at most ``buckets[-1]`` tokens (a "prompt" graph),
    or up to `ROW_MAX_REQUESTS` requests' new tokens, ``row_buckets[-1]`` in all, over any cached prefix,
    each in a context of at most ``max_context`` tokens (a "rows" graph).

    buckets:     ascending token counts of new prompts, one graph each
    row_buckets: ascending token counts of the rows graphs, one graph each (empty: none)
    max_context: the longest context of a rows graph (its indexer's logits width)
    """

    buckets: tuple[int, ...]
    row_buckets: tuple[int, ...] = ()
    max_context: int = 0

    def __post_init__(self) -> None:
        for name in ("buckets", "row_buckets"):
            b = getattr(self, name)
            if (name == "buckets" and not b) or list(b) != sorted(set(b)) or (b and b[0] < 1):
                raise ValueError(f"{name} must be ascending distinct positive ints, got {b}")
        if self.row_buckets and self.max_context < PAGE_SIZE:
            raise ValueError(f"rows graphs need max_context >= {PAGE_SIZE}, got {self.max_context}")

    @classmethod
    def for_limits(cls, max_tokens: int, max_context: int = 0) -> "PrefillGraphPlan":
        """New prompts up to ``max_tokens`` (`prefill_buckets`); with ``max_context`` > 0 also rows graphs of
        up to `row_cap` tokens in contexts up to ``max_context``."""
        rows = row_cap(max_tokens, max_context)
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
        """Page-table width of the rows graphs (``max_context`` tokens)."""
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

    def row_bucket(self, num_tokens: int) -> int | None:
        """The smallest rows bucket holding ``num_tokens`` tokens, or None."""
        return self._bucket(self.row_buckets, num_tokens)

    def kind(self, items) -> str | None:
        """``"prompt"`` or ``"rows"``: which graphs serve a PREFILL forward over ``items``
        (`workers.model_runner.WorkItem` s), or None (it runs eagerly)."""
        if not items or not all(isinstance(it.page_table, tuple) and it.token_ids for it in items):
            return None
        if len(items) == 1 and items[0].start == 0 and len(items[0].token_ids) <= self.max_tokens:
            return "prompt"
        if (self.row_buckets and len(items) <= ROW_MAX_REQUESTS
                and sum(len(it.token_ids) for it in items) <= self.row_buckets[-1]
                and all(it.end <= self.max_context for it in items)):
            return "rows"
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
        out_slots = torch.where(pos < p[T], slots_for_positions(table, pos), -1)
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


class RowInputs:
    """A PREFILL forward laid out as a decode step of one row per new token, on the device, sized for
    ``B`` rows (the largest rows bucket) of up to `ROW_MAX_REQUESTS` requests.

    ``packed`` int64 ``[3 B + 1 + 2 R + R P]``: each row's token, position and request (pad rows 0), the
    number of real rows ``n``, each request's context length after the forward and its new tokens, then
    the requests' page ids (``P`` = `PrefillGraphPlan.context_pages` each, unused entries 0); one
    host-to-device copy a step, of the requests' tables only.
    """

    def __init__(self, plan: PrefillGraphPlan, device: torch.device):
        self.plan, self.device = plan, device
        B, R, P = plan.row_buckets[-1], ROW_MAX_REQUESTS, plan.context_pages
        self.rows_max = B
        self._tables_at = 3 * B + 1 + 2 * R
        self.packed = torch.zeros(self._tables_at + R * P, dtype=torch.int64, device=device)
        self.rows = torch.arange(B, dtype=torch.int64, device=device)
        self.q_lens = torch.ones(B, dtype=torch.int64, device=device)

    def write(self, items) -> None:
        """The new tokens of ``items`` (`workers.model_runner.WorkItem` s; none: every row is a pad)."""
        B, R, P = self.rows_max, ROW_MAX_REQUESTS, self.plan.context_pages
        tokens, positions, req, ends, q_lens, tables = [], [], [], [], [], []
        for r, it in enumerate(items):
            n = len(it.token_ids)
            if it.end > self.plan.max_context or len(it.page_table) < pages_for_tokens(it.end):
                raise ValueError(f"{n} new tokens after {it.start} in {len(it.page_table)} pages are outside this "
                                 f"plan (contexts up to {self.plan.max_context})")
            tokens += it.token_ids
            positions += range(it.start, it.end)
            req += [r] * n
            ends.append(it.end)
            q_lens.append(n)
            pages = list(it.page_table[:P])
            tables += pages + [0] * (P - len(pages))
        n = len(tokens)
        if n > B or len(items) > R:
            raise ValueError(f"{n} new tokens of {len(items)} requests are outside this plan ({B} tokens, {R} requests)")
        pad, rpad = [0] * (B - n), [0] * (R - len(items))
        host = tokens + pad + positions + pad + req + pad + [n] + ends + rpad + q_lens + rpad + tables
        self.packed[:len(host)].copy_(to_device(torch.tensor(host, dtype=torch.int64), self.device))

    def batch(self, bucket: int) -> ForwardBatch:
        """The DECODE forward of ``bucket`` rows: row ``i < n`` is its request's token at its position,
        with context ``position + 1`` and its request's page table; the rest are padding rows (position
        0, context 1, slot ``-1``)."""
        B, R, P = self.rows_max, ROW_MAX_REQUESTS, self.plan.context_pages
        p = self.packed
        live = self.rows[:bucket] < p[3 * B]
        pos = torch.where(live, p[B: B + bucket], 0)
        tables, req = p[self._tables_at:].view(R, P), p[2 * B: 2 * B + bucket]
        page_tables = tables.index_select(0, req)
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=p[:bucket], positions=pos,
            out_slots=torch.where(live, slots_for_positions(tables, pos, req), -1),
            page_tables=page_tables.to(torch.int32), seq_lens=pos + 1, q_lens=self.q_lens[:bucket],
            max_seq_len=self.plan.max_context, static_shapes=True,
        )

    def real(self, full: ForwardBatch, items) -> ForwardBatch:
        """The PREFILL description of ``items`` (what callers read: the rows, lengths on the host and the
        device) from the bucket's views."""
        B, R, P = self.rows_max, ROW_MAX_REQUESTS, self.plan.context_pages
        n, k = sum(len(it.token_ids) for it in items), len(items)
        at = 3 * B + 1
        return ForwardBatch(
            mode=ForwardMode.PREFILL, input_ids=full.input_ids[:n], positions=full.positions[:n],
            out_slots=full.out_slots[:n], page_tables=self.packed[self._tables_at:].view(R, P)[:k].to(torch.int32),
            seq_lens=self.packed[at: at + k], q_lens=self.packed[at + R: at + R + k],
            max_seq_len=max(it.end for it in items), seq_lens_host=tuple(it.end for it in items),
            q_lens_host=tuple(len(it.token_ids) for it in items),
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
        self.row_inputs = RowInputs(plan, self.device) if plan.row_buckets else None
        # kind -> bucket -> (graph, its batch, its hidden output)
        self.graphs: dict[str, dict[int, tuple]] = {"prompt": {}, "rows": {}}
        self.replays = 0

    def covers(self, items) -> bool:
        return self.plan.covers(items)

    @torch.inference_mode()
    def capture_all(self, pool=None) -> None:
        """One graph per bucket of each kind (`workers.decode_graphs.capture_forwards`), on all-pad inputs,
        all in one memory pool (``pool`` when given)."""
        if not self.capture:
            return
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        self.inputs.write((), ())
        self.graphs["prompt"] = capture_forwards(self.model, self.cache, self.backend, self.device,
                                                 self.plan.buckets, self.inputs.batch, pool)
        if self.row_inputs is not None:
            self.row_inputs.write(())
            self.graphs["rows"] = capture_forwards(self.model, self.cache, self.backend, self.device,
                                                   self.plan.row_buckets, self.row_inputs.batch, pool)

    @torch.inference_mode()
    def run(self, items) -> tuple[ForwardBatch, torch.Tensor]:
        """The PREFILL forward over ``items`` (`covers`): (its batch, normed hidden ``[T, hidden]`` of its
        ``T`` new tokens). The hidden states are a view of the graph's output buffer, valid until the
        next forward in this memory pool (the runner's graphs share one; clone to keep); the batch's tensors are views of the bucket's
        buffers (the real rows), its lengths on the host."""
        kind = self.plan.kind(items)
        if kind is None:
            raise ValueError(f"a prefill of {[len(it.token_ids) for it in items]} tokens starting at "
                             f"{[it.start for it in items]} is outside this plan (one new prompt up to "
                             f"{self.plan.max_tokens} tokens; up to {ROW_MAX_REQUESTS} requests' "
                             f"{self.plan.row_buckets[-1] if self.plan.row_buckets else 0} tokens over cached prefixes)")
        n = sum(len(it.token_ids) for it in items)
        if kind == "prompt":
            bucket = self.plan.bucket(n)
            self.inputs.write(items[0].token_ids, items[0].page_table)
            make = self.inputs.batch
        else:
            bucket = self.plan.row_bucket(n)
            self.row_inputs.write(items)
            make = self.row_inputs.batch
        if self.capture:
            graph, full, hidden = self.graphs[kind][bucket]
            graph.replay()
            self.replays += 1
        else:
            full = make(bucket)
            hidden = self.model(full, self.cache, self.backend)
        batch = self.inputs.real(full, n) if kind == "prompt" else self.row_inputs.real(full, items)
        return batch, hidden[:n]
