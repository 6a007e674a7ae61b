"""Start-up prefill warm-up (`workers.kernel_warmup`): which lengths, and that it leaves no trace.

On the ``cuda`` backend `workers.replica_build.build_replica` runs it (the compile it saves is a GPU
matter: docs/perf.md); here it runs on the reference backend, where it must give back every page and
change no output.
"""

from __future__ import annotations

from models.tiny import make_tiny
from workers.kernel_warmup import warm_up_prefill, warmup_sizes
from workers.offline import LLM

PROMPTS = [[5, 9, 200, 17] * 5, [33] * 70]


def test_warmup_sizes():
    assert warmup_sizes(8192, 1 << 20) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert warmup_sizes(100, 1 << 20) == [16, 32, 64, 100]
    assert warmup_sizes(256, 40) == [16, 32, 40]


def test_warm_up_gives_every_page_back_and_changes_nothing(tmp_path):
    model = make_tiny("deepseek_v32", tmp_path / "v32", seed=0)
    cold = LLM(model, num_pages=16, chunk_size=200).generate(PROMPTS, max_new_tokens=6, ignore_eos=True)
    llm = LLM(model, num_pages=16, chunk_size=200)
    took = warm_up_prefill(llm.runner, llm.pool, 200, llm.cfg.max_position_embeddings)
    assert sorted(took) == [16, 32, 64, 128, 200]
    assert llm.pool.free_count == 16
    assert llm.generate(PROMPTS, max_new_tokens=6, ignore_eos=True) == cold
