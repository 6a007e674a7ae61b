"""The V4 indexer's scores in blocks of query rows (`models.v4.attention.weighted_relu_scores`): the
same values as the whole ``[S, H, N]`` product, and the same model output whatever the block size, on
fresh random inputs. (A 32k prompt in 8k chunks needed 64 GiB for the whole product on the H200.)"""

from __future__ import annotations

import random

import pytest
import torch

import models.v4.attention as v4_attention
from models.tiny_v4 import make_tiny_v4
from tests.workers.prompts import random_prompt
from workers.offline import LLM

SEED = random.randrange(1 << 30)


@pytest.mark.parametrize("block_bytes", [1, 4 * 7 * 33 * 5, 1 << 30])  # one row, 5 rows, all rows
def test_blocked_scores_equal_the_whole_product(monkeypatch, block_bytes):
    gen = torch.Generator().manual_seed(SEED)
    S, H, N, d = 37, 7, 33, 16
    q, keys, w = torch.randn(S, H, d, generator=gen), torch.randn(N, d, generator=gen), torch.randn(S, H, generator=gen)
    want = (torch.relu(torch.einsum("shd,nd->shn", q, keys)) * 0.25 * w[..., None]).sum(dim=1)
    monkeypatch.setattr(v4_attention, "SCORE_BLOCK_BYTES", block_bytes)
    got = v4_attention.weighted_relu_scores(q, keys, w, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"seed {SEED}")


def test_model_output_does_not_depend_on_the_block(monkeypatch, tmp_path):
    tiny = make_tiny_v4(tmp_path / "v4")
    prompt = random_prompt(300, 200, SEED % 1000)
    whole = LLM(tiny, num_pages=8, chunk_size=128).prompt_logits(prompt)
    monkeypatch.setattr(v4_attention, "SCORE_BLOCK_BYTES", 1)  # one query row at a time
    blocked = LLM(tiny, num_pages=8, chunk_size=128).prompt_logits(prompt)
    torch.testing.assert_close(blocked, whole, rtol=1e-4, atol=1e-4, msg=f"seed {SEED}")
