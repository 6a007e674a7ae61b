"""PrefillWorker: chunked prefill that pushes each finished chunk's pages to
the decode replica over NIXL and returns the first token + last hidden state.

With a prefix cache in the pool, a prompt's cached prefix is not computed
again (its first chunk starts after it), and the pages decode already holds
(``PrefillTask.decode_cached_pages``) are not pushed: the push covers the
prompt's positions after them, into the pages decode reserved for the rest."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace

import torch

from attention.formats import PAGE_SIZE, pages_for_tokens
from models.batch import ForwardMode
from transfer import PushStatus
from workers.host_copy import tensor_on
from workers.kv_link import KVLink
from workers.model_runner import ModelRunner, WorkItem
from workers.page_pool import PagePool
from workers.prefix_cache import held_keys, waits_for_computing
from workers.page_tables import frozen_pages
from workers.sample.metadata import SamplingMetadata, TokenHistory
from workers.sample.output import SampleOutput, read_back
from workers.sample.params import SamplingParams
from workers.sample.prompt_logprobs import PromptLogprobs, PromptRows
from workers.sample.ops.grammar_mask import GrammarMask
from workers.sample.sampler import sample_hidden
from workers.structured import GrammarCompiler, MaskJob


@dataclass
class PrefillTask:
    """What decode asks of prefill: where the pages go, how to sample token 1."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    decode_agent: str
    decode_pages: list[int]
    """The pages decode reserved for what it does not hold: the prompt's pages after its cached ones."""
    decode_cached_pages: int = 0
    """Leading pages of the prompt decode already holds in its prefix cache: not pushed."""
    prefix_keys: tuple[int, list[bytes]] | None = field(default=None, repr=False, compare=False)
    """The prompt's prefix-cache page keys, filled by the prefill worker the first time it needs them
    (`workers.prefix_cache.held_keys`)."""

    def check(self) -> None:
        """Raises ``ValueError`` unless ``decode_cached_pages`` and ``decode_pages`` cover the prompt's pages
        and at least its last token is pushed (decode reuses at most the pages before it)."""
        n, skip = len(self.token_ids), self.decode_cached_pages
        if not n:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        if not 0 <= skip <= (n - 1) // PAGE_SIZE or len(self.decode_pages) + skip != pages_for_tokens(n):
            raise ValueError(f"request {self.request_id}: decode_cached_pages {skip} + {len(self.decode_pages)} "
                             f"decode_pages do not cover a prompt of {n} tokens ({pages_for_tokens(n)} pages, "
                             f"at most {(n - 1) // PAGE_SIZE} cached)")

    @property
    def skip_tokens(self) -> int:
        """Prompt positions decode holds (never pushed)."""
        return self.decode_cached_pages * PAGE_SIZE


@dataclass
class PrefillResult:
    """first_token / first_logprob: the sampled token after the prompt.
    last_hidden: fp32 ``[hidden]`` target hidden state of the last prompt
    position (decode's first MTP draft needs it). seed / rng_offset: the
    request's random stream and the draws prefill used of it (decode
    continues the same stream: two ints, ``workers.sample.ops.rng``).
    first_top_logprobs: token 1's top log-probabilities, when asked.
    prompt_logprobs: the prompt's log-probabilities, when asked (computed in
    this prefill; decode sends them out with token 1).
    ``ok`` is False when the push failed, expired or was cancelled."""

    request_id: str
    ok: bool
    first_token: int = -1
    first_logprob: float = 0.0
    last_hidden: torch.Tensor | None = None
    seed: int | None = None
    rng_offset: int = 0
    first_top_logprobs: dict[int, float] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    error: str = ""
    push_status: str = ""
    """How the push ended (`transfer.PushStatus` value); empty if it never began."""
    push_nbytes: int = 0
    """Bytes the push's WRITEs carried."""
    push_tail_s: float = 0.0
    """`transfer.PushResult.tail_seconds`: the transfer after the prompt's last forward."""
    push_s: float = 0.0
    """`transfer.PushResult.seconds`: the whole push, from the task's admission to its end."""


@dataclass
class _Active:
    task: PrefillTask
    page_table: list[int]
    seed: int
    done: int = 0
    result: PrefillResult | None = None
    first_mask: MaskJob | None = None
    """Token 1's grammar mask (structured outputs): the grammar's start state, filled at submit."""
    prompt_logprobs: PromptLogprobs | None = None
    push_tokens: int = 0
    """The prompt length as the push counts it (`PagePool.transfer_plan`)."""


FINAL_PUSH_WAIT_S = 0.05
"""How long a round waits for the WRITEs of the prompts it just finished. Decode learns that a push
is complete only from a notification that NIXL sends when a poll here sees the copies done; a
following forward, or the engine's idle sleep, would delay that poll and the request's first token
(by a whole forward, or up to the sleep). The round spins on the WRITEs' states instead
(`Pusher.poll`'s ``spin_s``): the copies of a 32k-token DeepSeek-V3.2 prompt take 1-5 ms
(docs/perf.md), so the worker thread waits that long per prompt at most once, and queues the next
forward that much later (the GPU idles meanwhile only if nothing else was queued)."""


class PrefillWorker:
    def __init__(self, runner: ModelRunner, pool: PagePool, link: KVLink, chunk_size: int = 256,
                 mtp: bool = False, deadline_s: float = 60.0, final_push_wait_s: float = FINAL_PUSH_WAIT_S,
                 grammars: GrammarCompiler | None = None):
        """grammars: the replica's grammar compiler (structured outputs; None: constrained requests are refused)."""
        self.runner, self.pool, self.link = runner, pool, link
        self.grammars = grammars
        self.chunk_size, self.mtp, self.deadline_s = chunk_size, mtp, deadline_s
        self.final_push_wait_s = final_push_wait_s
        self.pusher = link.pusher()  # a tensor-parallel replica's link pushes rank i -> rank i
        self.active: dict[str, _Active] = {}
        # The replica's RNG: only the seeds of requests that bring none come from it.
        self._seeds = random.Random()

    def submit(self, task: PrefillTask) -> None:
        """Take local pages (the prompt's cached prefix first: not computed again) and start tracking the
        push of the pages decode does not hold (raises ``PoolExhausted``, ``ValueError``)."""
        if self.pool.pushes_by_chunk:
            task.check()
        elif not task.token_ids:
            raise ValueError(f"request {task.request_id}: the prompt is empty")
        else:  # a grouped cache (V4): decode may share a cut of the prompt (`workers.v4_prefix`)
            self.pool.check_skip(len(task.token_ids), task.decode_cached_pages)
        n, skip = len(task.token_ids), task.decode_cached_pages
        first_mask = self._start_mask(task.params)  # before any page is taken: it raises for a bad grammar
        prompt_logprobs = PromptLogprobs.wanted(task.params, n)
        # Prompt logprobs need every position's logits: such a prompt reuses nothing.
        pages, cached = self.pool.acquire_tokens(task.token_ids, n, reuse=prompt_logprobs is None)
        # The push covers the positions after decode's cached pages (a grouped cache: every page's units).
        ids, push_tokens = self.pool.transfer_plan(pages, n, skip)
        try:
            # A prompt computed over more than a round's budget is surely pushed in several chunks: no
            # whole-request WRITE to prepare.
            self.pusher.begin(task.request_id, task.decode_agent, push_tokens, ids, task.decode_pages,
                              self.deadline_s, prepare=n - cached * PAGE_SIZE <= self.chunk_size
                              or not self.pool.pushes_by_chunk)
        except Exception:
            self.pool.free(pages)
            raise
        seed = task.params.seed if task.params.seed is not None else self._seeds.getrandbits(64)
        self.active[task.request_id] = _Active(task, pages, seed, done=cached * PAGE_SIZE,
                                               prompt_logprobs=prompt_logprobs, push_tokens=push_tokens)
        self.active[task.request_id].first_mask = first_mask

    def waits_for_prefix(self, task: PrefillTask) -> bool:
        """Whether ``task`` should wait before `submit`: prompts this worker is computing now will cache more of
        its leading pages than the prefix cache holds (`workers.prefix_cache.waits_for_computing`, the
        scheduler's rule). Its callers submit the tasks queued behind it meanwhile."""
        cache = self.pool.prefix_cache
        if cache is None or not self.pool.publishes or PromptLogprobs.wanted(task.params, len(task.token_ids)):
            return False
        computing = {key for a in self.active.values() if a.done < len(a.task.token_ids)
                     for key in held_keys(cache, a.task, a.task.token_ids)}
        return bool(computing) and waits_for_computing(cache, task.token_ids, held_keys(cache, task, task.token_ids),
                                                       computing)

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        if request_id not in self.active:
            return
        # Ends the push (decode is told); its result is this call, not a later poll.
        self.pusher.abort(request_id, reason)
        self._release(request_id)

    def _release(self, request_id: str, cache: bool = False) -> _Active | None:
        """Drop the request and its pages; ``cache``: its prompt is computed and pushed, so its full pages
        stay in the prefix cache (every position before the last token: the MTP layer's entry of the last
        is written by decode, once token 1 is known)."""
        a = self.active.pop(request_id, None)
        if a is not None:
            if cache:
                self.pool.free(a.page_table, a.task.token_ids, len(a.task.token_ids) - 1)
            else:
                self.pool.free(a.page_table)
        return a

    @torch.inference_mode()
    def step(self) -> list[PrefillResult]:
        """One round: the next chunk of every active request (one PREFILL
        forward within ``chunk_size`` tokens), push what became final, and
        return results of requests whose push ended."""
        budget, items, chosen = self.chunk_size, [], []
        for a in self.active.values():
            n = len(a.task.token_ids)
            if a.done >= n or budget == 0:
                continue
            end = min(n, a.done + budget)
            items.append(WorkItem(tuple(a.task.token_ids[a.done:end]), a.done, frozen_pages(a.page_table)))
            chosen.append((a, a.done, end))
            budget -= end - a.done
        if items:
            self._run(items, chosen)
        finished = {a.task.request_id for a, _, end in chosen if end == len(a.task.token_ids)}
        # One plain poll, then, while a prompt finished here is still pushing, spin: see its push
        # end now (decode is notified by the poll that sees it), not after the next forward or
        # idle sleep.
        t_end = time.monotonic() + self.final_push_wait_s
        results, spin_s = [], 0.0
        while True:
            results += self._results(self.pusher.poll(spin_s=spin_s))
            spin_s = t_end - time.monotonic()
            if spin_s <= 0 or not finished.intersection(self.pusher.active):
                return results

    def _results(self, pushes) -> list[PrefillResult]:
        """Results of requests whose push ended (their pages are freed)."""
        out = []
        for res in pushes:
            a = self._release(res.request_id, cache=res.status is PushStatus.DONE)
            if a is None:
                continue
            push = dict(push_status=res.status.value, push_nbytes=res.nbytes, push_tail_s=res.tail_seconds,
                        push_s=res.seconds)
            if res.status is PushStatus.DONE and a.result is not None:
                out.append(replace(a.result, **push))
            else:
                out.append(PrefillResult(res.request_id, False, error=f"push {res.status.value}: {res.reason}", **push))
        return out

    def _run(self, items, chosen) -> None:
        batch, hidden = self.runner.forward(ForwardMode.PREFILL, items)
        ranges = batch.query_ranges()
        if self.mtp:
            self._run_mtp(chosen, ranges, hidden)
        self._prompt_logprobs(chosen, ranges, hidden)
        finishing, rows = [], []
        for (a, start, end), (s0, s1) in zip(chosen, ranges):
            a.done = end
            if end == len(a.task.token_ids):
                finishing.append(a)
                rows.append(s1 - 1)
        if finishing:
            self._sample_first(finishing, hidden.index_select(0, tensor_on(rows, torch.int64, hidden.device)))
        # A chunk's pages are final in every layer, the MTP layer's included. After a read-back they
        # are written: a fence (a CUDA event the pusher polls) would only delay the WRITE of a prompt's
        # last chunk, the one its first token waits for (docs/perf.md, session 8).
        for a, _, end in chosen:
            # Written in every layer (the MTP layer's too, below the last prompt position: `_run_mtp`): a
            # prompt submitted from now on with this prefix reuses these pages.
            self.pool.publish(a.task.token_ids, a.page_table, min(end, len(a.task.token_ids) - 1))
            if not self.pool.pushes_by_chunk:  # grouped caches: every page once the state is final
                if end == len(a.task.token_ids):
                    self.pusher.push(a.task.request_id, a.push_tokens, written=True)
            elif end > a.task.skip_tokens:  # positions decode holds are never pushed
                self.pusher.push(a.task.request_id, end - a.task.skip_tokens, written=bool(finishing))

    def _sample_first(self, finishing: list[_Active], last_hidden: torch.Tensor) -> None:
        """Token 1 of every prompt finished this round, sampled as one batch (draw 0 of each
        request's stream), read back with the last hidden states ``[F, hidden]`` in one copy.
        The MTP layer ran first (it needs the prompt's tokens, not the sampled one), so the
        read-back waits for every kernel that wrote this round's pages."""
        params = [a.task.params for a in finishing]
        meta = SamplingMetadata.build(params, [a.seed for a in finishing], [0] * len(finishing), last_hidden.device,
                                      eos_token_ids=self.runner.model.cfg.eos_token_ids)
        history = None
        if meta.penalties is not None:
            # Nothing is generated before token 1: only the repetition penalty sees tokens (the prompt's).
            history = TokenHistory.build([a.task.token_ids if p.repetition_penalty != 1.0 else None
                                          for a, p in zip(finishing, params)], [None] * len(finishing),
                                         last_hidden.device)
        meta.grammar = self._first_masks(finishing, last_hidden.device)
        out = sample_hidden(self.runner.model, last_hidden, meta, history)
        # The prompts' logprob rows (kept on the device since their chunks ran) come back in the same copy.
        lps = [a.prompt_logprobs for a in finishing if a.prompt_logprobs is not None and a.prompt_logprobs.parts]
        packed, hidden, *lp_rows = read_back(out.packed(), last_hidden, *(torch.cat(p.parts) for p in lps))
        for p, rows in zip(lps, lp_rows):
            p.parts = []
            p.add_rows(rows.tolist())
        for a, s, h in zip(finishing, SampleOutput.unpack(packed.tolist(), meta.top_logprobs), hidden):
            a.result = PrefillResult(a.task.request_id, True, s.token, s.logprob, h.clone(), a.seed, 1,
                                     s.top_logprobs, a.prompt_logprobs)

    def _prompt_logprobs(self, chosen, ranges, hidden: torch.Tensor) -> None:
        """The prompt logprobs of this round's positions, for the requests that asked: packed rows
        left on the device (``PromptLogprobs.parts``) until the prompt's last chunk reads them back."""
        rows = PromptRows()
        for (a, start, end), (s0, _) in zip(chosen, ranges):
            if a.prompt_logprobs is not None:
                rows.add(a.prompt_logprobs, a.task.token_ids, start, end, s0)
        if rows:
            model = self.runner.model
            for state, part in rows.split(rows.compute(model.logits, hidden, model.cfg.vocab_size)):
                state.parts.append(part)

    def _start_mask(self, params: SamplingParams) -> MaskJob | None:
        """Token 1's grammar mask, started on the compiler's thread while the prompt's chunks run
        (decode's matcher replays token 1 later: `workers.engine.Engine.admit_prefilled`)."""
        if params.grammar is None:
            return None
        if self.grammars is None:
            raise ValueError("structured outputs (a grammar) need the checkpoint's tokenizer")
        return self.grammars.masks([0], [self.grammars.matcher(params.grammar)],
                                   pin=torch.device(self.runner.device).type == "cuda")

    def _first_masks(self, finishing: list[_Active], device: torch.device) -> GrammarMask | None:
        """The constrained rows' masks of a `_sample_first` batch (None when no row has a grammar)."""
        rows = [i for i, a in enumerate(finishing) if a.first_mask is not None]
        if not rows:
            return None
        bitmask = torch.cat([finishing[i].first_mask.wait(device).bitmask for i in rows])
        return GrammarMask(tensor_on(rows, torch.int64, device), bitmask)

    def _run_mtp(self, chosen, ranges, hidden: torch.Tensor) -> None:
        """The MTP layer's cache for this round's positions whose next token is in the prompt
        (position n-1 is written by decode once token 1 is known). ``hidden``: [tokens, hidden]."""
        mtp_items, mtp_hidden = [], []
        for (a, start, end), (s0, _) in zip(chosen, ranges):
            known_end = min(end, len(a.task.token_ids) - 1)
            if known_end > start:
                mtp_items.append(WorkItem(tuple(a.task.token_ids[start + 1:known_end + 1]), start,
                                          frozen_pages(a.page_table)))
                mtp_hidden.append(hidden[s0:s0 + known_end - start])
        if mtp_items:
            mbatch = self.runner.build_batch(ForwardMode.PREFILL, mtp_items)
            self.runner.model.mtp_forward(mbatch, torch.cat(mtp_hidden), self.runner.cache, self.runner.backend,
                                          draft=False)
