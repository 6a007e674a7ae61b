"""What the serving tests compare served output with: the offline engine on the same checkpoint
(imported by the serve test modules, not a conftest)."""

from __future__ import annotations

import contextlib
import random

MAX_REF_TOKENS = 40


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


class Reference:
    """Greedy continuations of the offline engine, all computed in one batch (``MAX_REF_TOKENS``
    each, EOS ignored): a shorter or EOS-stopping request's answer is a prefix of it."""

    def __init__(self, llm, tok, prompts: dict[str, list[int]]):
        self.llm, self.tok, self.prompts = llm, tok, prompts
        names = list(prompts)
        outs = llm.generate([prompts[n] for n in names], max_new_tokens=MAX_REF_TOKENS, ignore_eos=True)
        self.out = dict(zip(names, outs))

    def expect(self, name: str, max_tokens: int, ignore_eos: bool = False) -> tuple[str, int, str]:
        """(text, completion tokens, finish reason) for prompt ``name``."""
        assert max_tokens <= MAX_REF_TOKENS
        out, finish = self.out[name][:max_tokens], "length"
        if not ignore_eos:
            for i, t in enumerate(out):
                if t in self.llm.cfg.eos_token_ids:
                    out, finish = out[: i + 1], "stop"
                    break
        return self.tok.decode(out, skip_special_tokens=True), len(out), finish


@contextlib.contextmanager
def reference_llm(args, **llm_kwargs):
    """``(LLM, tokenizer, model_dir)`` of ``args``' model (an ``AppConfig``) with its decode role's dtype and
    KV format, while the server starts. The checkpoint is the servers' (`shared_cache_dir`): made here
    if this comes first (then the server's build finds it), by the same code from the same spec either
    way; making is atomic. One torch thread: next to the server's processes, two OpenMP threads spin at
    every barrier while the other waits for a core (10x slower here)."""
    import torch
    from transformers import AutoTokenizer

    from tests.deployments.serve_process import shared_cache_dir
    from workers.offline import LLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = args.model.model_copy(update={"cache_dir": str(shared_cache_dir())})
        model_dir = src.checkpoint_dir(make=True)
        d = args.decode
        llm = LLM(model_dir, backend=d.backend, device=d.device, dtype=d.dtype, kv_cache_dtype=d.kv_cache_dtype,
                  **llm_kwargs)
        yield llm, AutoTokenizer.from_pretrained(model_dir), model_dir
    finally:
        torch.set_num_threads(threads)
