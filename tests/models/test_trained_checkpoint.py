"""The shipped trained checkpoint (models/checkpoints/small-v32, `models.train`): transformers and our
engine agree on it, its MTP layer drafts well, and it writes English.

Skipped with a reason until the checkpoint is in the tree (docs/training.md says how it is made).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

CKPT = Path(__file__).resolve().parents[2] / "models" / "checkpoints" / "small-v32"
pytestmark = pytest.mark.skipif(not (CKPT / "config.json").exists(),
                                reason=f"no trained checkpoint at {CKPT} (docs/training.md)")

TEXT = ("The interpreter reads a line of input, parses it into tokens and executes the statements one "
        "at a time. When an exception is raised and not handled, the interpreter prints a traceback and "
        "the program stops. Modules group related functions and classes, and a package is a directory of "
        "modules with a name of its own. A function is defined with the def keyword, followed by its name and")
CHAT = [{"role": "user", "content": "What does the word \"garden\" mean?"}]


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.workers.hf_tiny import use_tie_rule
    from workers.offline import LLM

    tok = AutoTokenizer.from_pretrained(CKPT)
    hf = use_tie_rule(AutoModelForCausalLM.from_pretrained(CKPT, dtype=torch.float32,
                                                           attn_implementation="eager").eval())
    return tok, hf, LLM(CKPT, dtype="float32", kv_cache_dtype="auto")


def _prompts(tok) -> list[list[int]]:
    chat = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    return [tok(TEXT)["input_ids"], tok(chat, add_special_tokens=False)["input_ids"]]


def test_transformers_loads_it_and_prompt_logits_match(models):
    tok, hf, ours = models
    assert type(hf).__name__ == "DeepseekV32ForCausalLM"
    ids = tok(TEXT)["input_ids"]
    assert len(ids) > hf.config.index_topk  # the indexer really selects
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours.prompt_logits(ids), ref, rtol=1e-4, atol=1e-4)


def test_greedy_matches_transformers(models):
    """Our greedy continuation, teacher-forced through transformers: every token we chose is
    transformers' argmax, or within 1e-4 (the prompt-logit tolerance above) of its max logit.
    A trained model has near-ties (e.g. "garden;" vs "garden," at a 2e-5 gap) where fp32
    summation order decides, and after one the two continuations are different texts; a
    real disagreement (a wrong logit) is far larger than that."""
    tok, hf, ours = models
    prompts = _prompts(tok)
    got = ours.generate(prompts, max_new_tokens=32, ignore_eos=True)
    exact = 0
    for p, g in zip(prompts, got):
        with torch.no_grad():
            logits = hf(torch.tensor([p + g])).logits[0, len(p) - 1: -1].float()
        best = logits.max(dim=-1).values
        chosen = logits[torch.arange(len(g)), torch.tensor(g)]
        gap = best - chosen
        assert float(gap.max()) <= 1e-4, (tok.decode(g), gap.tolist())
        exact += int((gap == 0).sum())
    assert exact >= len(prompts) * 32 - 2  # near-ties are rare, not the rule


def test_mtp_drafts_are_accepted_and_change_nothing(models):
    tok, _, ours = models
    from workers.offline import LLM

    prompts = _prompts(tok)
    base = ours.generate(prompts, max_new_tokens=32, ignore_eos=True)
    mtp = LLM(CKPT, dtype="float32", kv_cache_dtype="auto", mtp_draft_tokens=2)
    assert mtp.generate(prompts, max_new_tokens=32, ignore_eos=True) == base
    # A trained next-next-token layer: well above what a random one gets (~1/vocab).
    assert mtp.stats()["mtp_acceptance_rate"] > 0.2
    # PD with MTP (pages pushed over NIXL in DRAM, decode drafting from prefill's hidden state) equals
    # monolithic with MTP, and so the run without MTP.
    pd = LLM(CKPT, dtype="float32", kv_cache_dtype="auto", mtp_draft_tokens=2, pd=True)
    assert pd.generate(prompts, max_new_tokens=32, ignore_eos=True) == base
    assert pd.stats()["mtp_acceptance_rate"] > 0.2


def test_it_writes_english(models):
    tok, _, ours = models
    out = ours.generate([tok(TEXT)["input_ids"]], max_new_tokens=48, ignore_eos=True)[0]
    text = tok.decode(out, skip_special_tokens=True)
    words = text.lower().split()
    assert sum(c.isalpha() or c.isspace() or c in ".,;:'\"()-" for c in text) > 0.9 * len(text), text
    assert len(words) >= 20 and {"the", "a", "of", "is", "to", "and"} & set(words), text
