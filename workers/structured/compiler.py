"""`GrammarCompiler`: one replica's grammar engine (llguidance) over the checkpoint's tokenizer.

Compiling is the expensive part of a grammar (building its lexer and the
token trie walk's caches: ~1 ms for a small JSON schema, up to ~100 ms for a
large one); a request gets a cheap ``deep_copy`` of a cached compiled matcher,
so the clients that send the same schema on every request (tool definitions,
a response format) compile it once per replica. The cache is an LRU of
compiled matchers keyed by `GrammarSpec`.

Token bitmasks are filled by llguidance's executor (Rust threads, the GIL
released) from a Python worker thread: `masks` returns at once and the
engine launches the forward meanwhile (`workers.structured.matcher.MaskJob`).
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from workers.structured.matcher import GrammarMatcher, MaskJob
from workers.structured.spec import GrammarSpec, regex_literal

CACHE_SIZE = 256
"""Compiled grammars kept per replica (least recently used ones are dropped)."""

MASK_THREADS = 4
"""llguidance executor threads filling a batch's masks (at most the CPUs there are)."""


class GrammarError(ValueError):
    """A grammar that does not compile (its message is llguidance's, for a 400 naming the field)."""


class GrammarCompiler:
    """Compiles `GrammarSpec` s against one tokenizer and fills token bitmasks.

    tokenizer: the checkpoint's ``PreTrainedTokenizerFast``; vocab_size: the
    model's vocabulary (the logits' width, which may exceed the tokenizer's:
    ids past the tokenizer are never allowed); eos_token_ids: the model's
    EOS ids (allowed once a grammar is complete). The llguidance tokenizer is
    built on first use (about a second for a 128k vocabulary), so a replica
    that never sees a constrained request never pays for it.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int] = (), cache_size: int = CACHE_SIZE):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = list(eos_token_ids) or [tokenizer.eos_token_id]
        self.cache_size = cache_size
        self._llt = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, object] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._executor = None
        self.compiled = 0
        """Grammars compiled so far (cache misses): tests check that repeats hit the cache."""

    @classmethod
    def for_checkpoint(cls, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int] = ()
                       ) -> "GrammarCompiler | None":
        """The compiler of a checkpoint's tokenizer; None for a token-id-only checkpoint
        (constrained requests are then refused)."""
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError):
            return None
        return cls(tok, vocab_size, eos_token_ids)

    # ------------------------------------------------------------ tokenizer
    @property
    def tokenizer_ready(self) -> bool:
        """llguidance's tokenizer is built (`ll_tokenizer` is then cheap: writing a grammar's text is)."""
        return self._llt is not None

    @property
    def ll_tokenizer(self):
        if self._llt is None:
            with self._lock:
                if self._llt is None:
                    import llguidance.hf

                    self._llt = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                             eos_token=self.eos_token_ids)
        return self._llt

    def special_ref(self, text: str) -> str | None:
        """``<[id]>`` when ``text`` is one added token that llguidance treats as special (it does so
        for every ``<...>``-shaped one: ``</think>``, ``<tool_call>``): a grammar can only name such a
        token, not spell it. None otherwise (the text is matched as bytes, by any tokenization)."""
        tid = self.tokenizer.get_added_vocab().get(text)
        if tid is not None and self.ll_tokenizer.is_special_token(tid):
            return f"<[{tid}]>"
        return None

    def literal(self, text: str) -> str:
        """Lark for exactly ``text``: its special added tokens as ``<[id]>``, the rest as strings."""
        specials = sorted((t for t in self.tokenizer.get_added_vocab() if t and t in text and self.special_ref(t)),
                          key=len, reverse=True)
        parts, i = [], 0
        while i < len(text):
            hit = next((t for t in specials if text.startswith(t, i)), None)
            if hit is not None:
                parts.append(self.special_ref(hit))
                i += len(hit)
                continue
            j = min((text.find(t, i) for t in specials if text.find(t, i) >= 0), default=len(text))
            parts.append(json.dumps(text[i:j], ensure_ascii=False))
            i = j
        return " ".join(parts) if parts else '""'

    def text_until(self, close: str, name: str, body: str = "(?s:.*)") -> tuple[str, str]:
        """(a Lark expression, the definitions it uses): text matching the regex ``body`` that never
        contains ``close``, then ``close``; ``name`` names the definitions (unique per grammar).

        A special token closes after a terminal that excludes its text (the model must end with the
        token; spelling it in bytes is refused, so a text parser cannot cut the value short); any
        other closing text ends a lazy lexeme at its first occurrence."""
        ref = self.special_ref(close)
        if ref is not None:
            term = name.upper().replace("-", "_")
            return f"{term} {ref}", f"{term}: /{body}/ & ~/(?s:.*){regex_literal(close)}(?s:.*)/\n"
        rule = name.lower().replace("-", "_")
        return rule, f"{rule}[lazy]: /(?:{body}){regex_literal(close)}/\n"

    # ------------------------------------------------------------ compiling
    def grammar_text(self, spec: GrammarSpec) -> str:
        """The llguidance grammar (``{"grammars": [...]}`` JSON) of ``spec``, reasoning prefix included."""
        try:
            body = spec.body()
        except ValueError as e:
            raise GrammarError(str(e)) from e
        if spec.reasoning_end is None:
            return json.dumps({"grammars": [body]})
        expr, defs = self.text_until(spec.reasoning_end, "reasoning")
        wrapper = f"start: {expr} @body\n{defs}"
        return json.dumps({"grammars": [{"lark_grammar": wrapper}, {**body, "name": "body"}]})

    def _template(self, spec: GrammarSpec):
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        from llguidance import LLMatcher

        # log_level 0: a refused token is reported through is_error(), not printed.
        m = LLMatcher(self.ll_tokenizer, self.grammar_text(spec), log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error().strip())
        with self._lock:
            self.compiled += 1
            self._cache[spec] = m
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return m

    def is_compiled(self, spec: GrammarSpec) -> bool:
        """``spec`` is in the cache (`validate` / `matcher` of it compile nothing)."""
        with self._lock:
            return spec in self._cache

    def validate(self, spec: GrammarSpec) -> str:
        """'' when ``spec`` compiles (it is then cached), else llguidance's error message."""
        try:
            self._template(spec)
        except GrammarError as e:
            return str(e)
        return ""

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher of ``spec`` (a copy of the cached compiled one); raises `GrammarError`."""
        return GrammarMatcher(self._template(spec).deep_copy())

    # --------------------------------------------------------------- masks
    def masks(self, rows: Sequence[int], matchers: Sequence[GrammarMatcher], width: int = 1,
              drafts: Sequence[Sequence[int]] | None = None, pin: bool = False) -> MaskJob:
        """Start filling the token bitmasks of ``matchers`` (batch rows ``rows``) on a worker thread.

        width: positions per row (1, or ``k + 1`` for an MTP verify step: position j's mask is the
        state after the row's ``drafts[i][:j]``, as far as the grammar accepts them; positions after a
        refused draft allow everything, they are never reached). pin: page-locked host memory (for a
        non-blocking copy to a CUDA device). Returns a `MaskJob`; its ``wait`` gives the device mask.
        """
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    import llguidance

                    self._executor = llguidance.LLExecutor(max(1, min(MASK_THREADS, os.cpu_count() or 1)))
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        words = (self.vocab_size + 31) // 32
        n = len(matchers)
        # -1 (all bits set) allows every token: what a row keeps where llguidance writes nothing.
        host = torch.full((n * width, words), -1, dtype=torch.int32, pin_memory=pin)
        lls = [m.ll for m in matchers]
        ds = [list(d)[: width - 1] for d in drafts] if drafts is not None else [[] for _ in matchers]

        def fill() -> torch.Tensor:
            # A matcher in error (it consumed a refused token) keeps its row open: the engine ends
            # that request with an error when it emits, never samples from an all-masked row.
            live = [i for i, m in enumerate(lls) if not m.is_error()]
            if width == 1:
                self._executor.unsafe_compute_mask_ptr([(lls[i], i) for i in live], host.data_ptr(), words * 4, n)
            else:
                self._executor.unsafe_compute_mask_ptr_with_draft_token(
                    [(lls[i], i * width, ds[i]) for i in live], host.data_ptr(), words * 4, n * width)
            return host

        return MaskJob(self._pool.submit(fill), list(rows), n, width)
