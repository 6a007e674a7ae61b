"""Offline API: ``LLM(model_dir).generate(...)`` without any server.

This is the API every correctness check uses. Decode runs through the paged
caches (never a full recompute) with all live requests batched per step.
"""

from __future__ import annotations

from pathlib import Path

import torch

from attention.backend import get_backend
from attention.cache import PagedKVCache
from attention.formats import pages_for_tokens
from models.batch import ForwardMode
from models.loader import load_model
from workers.model_runner import ModelRunner, WorkItem, cache_spec_for
from workers.page_pool import PagePool
from workers.sampler import SamplingParams, sample

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class LLM:
    """A model replica in-process.

    dtype: ``"float32"`` | ``"bfloat16"`` (weights and activations).
    kv_cache_dtype: ``"auto"`` keeps the MLA latent and indexer keys unquantized
    in ``dtype`` (exact math, for comparisons); ``"fp8"`` uses the serving byte
    formats (656-byte MLA tokens, 132-byte indexer tokens).
    """

    def __init__(self, model_dir: str | Path, backend: str = "reference", device: str = "cpu",
                 dtype: str = "float32", kv_cache_dtype: str = "auto", num_pages: int = 512,
                 hadamard: bool | None = None):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
        self.model_dir = Path(model_dir)
        # The Hadamard rotation only matters once keys are quantized; in exact
        # mode it is skipped, as in transformers' reference.
        hadamard = kv_cache_dtype == "fp8" if hadamard is None else hadamard
        self.model = load_model(self.model_dir, _DTYPES[dtype], device, hadamard=hadamard)
        self.cfg = self.model.cfg
        self.pool = PagePool(num_pages)
        self.cache = PagedKVCache(cache_spec_for(self.model, num_pages, kv_cache_dtype), device)
        self.runner = ModelRunner(self.model, self.cache, get_backend(backend), device)

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 ``[len(token_ids), vocab]``: the logits after every prompt token."""
        pages = self.pool.allocate_for_tokens(len(token_ids))
        try:
            batch, hidden = self.runner.forward(ForwardMode.EXTEND, [WorkItem(tuple(token_ids), 0, tuple(pages))])
            with torch.inference_mode():
                return self.model.logits(hidden).cpu()
        finally:
            self.pool.free(pages)

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 16, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop_token_ids: tuple[int, ...] = (), ignore_eos: bool = False) -> list[list[int]]:
        """Generate for every prompt; returns the new token ids of each (ending at
        the first EOS / stop token, which is included, unless ``ignore_eos``)."""
        params = SamplingParams(max_new_tokens, temperature, top_p, top_k, seed, tuple(stop_token_ids), ignore_eos)
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        stops = set(params.stop_token_ids) | (set() if ignore_eos else set(self.cfg.eos_token_ids))
        gens = [torch.Generator().manual_seed(seed + i) if seed is not None else None for i in range(len(prompts))]
        pages = []
        try:
            for p in prompts:
                pages.append(tuple(self.pool.allocate(pages_for_tokens(len(p) + max_new_tokens))))
            items = [WorkItem(tuple(p), 0, pg) for p, pg in zip(prompts, pages)]
            batch, hidden = self.runner.forward(ForwardMode.EXTEND, items)
            logits = self.runner.last_token_logits(batch, hidden)
            outs = [[sample(logits[i], params, gens[i])] for i in range(len(prompts))]
            live = [i for i in range(len(prompts)) if outs[i][-1] not in stops and max_new_tokens > 1]
            while live:
                items = [WorkItem((outs[i][-1],), len(prompts[i]) + len(outs[i]) - 1, pages[i]) for i in live]
                batch, hidden = self.runner.forward(ForwardMode.DECODE, items)
                logits = self.runner.last_token_logits(batch, hidden)
                for row, i in enumerate(live):
                    outs[i].append(sample(logits[row], params, gens[i]))
                live = [i for i in live if outs[i][-1] not in stops and len(outs[i]) < max_new_tokens]
            return outs
        finally:
            for pg in pages:
                self.pool.free(list(pg))
