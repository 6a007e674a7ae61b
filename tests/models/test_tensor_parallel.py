"""Tensor parallelism of the model itself: tp = 2 in two real processes (gloo)
equals tp = 1.

Each rank loads its shard (heads, routed experts, dense / shared-expert MLP
columns sliced by the loader), keeps its own full MLA latent and indexer
cache, and runs the same engine (scheduler, greedy sampler: the logits are
bitwise equal on every rank after the all-reduces, so every rank takes the
same decisions). Rank 0 reports prompt logits and greedy outputs, which must
equal a single-process run to fp32 rounding of a different summation order.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models.batch import ForwardMode
from models.moe.layer import MoE
from models.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TPContext
from models.tiny import make_tiny
from tests.workers.prompts import random_prompt
from workers.engine import Engine
from workers.model_runner import WorkItem
from workers.page_pool import PagePool
from workers.rank_build import RankSpec, build_rank
from workers.request import Request
from workers.sample.params import SamplingParams
from workers.scheduler import SchedulerConfig

# Longer than index_topk (16): the sparse selection is exercised; 70 crosses a page.
PROMPTS = [random_prompt(n, 300, 100 + n) for n in (40, 70, 5)]
NEW_TOKENS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_replica(model_dir: Path, tp: TPContext, kv_cache_dtype: str, mtp: int, tbo: bool = False,
                 fp8: bool = False) -> dict:
    """Prompt logits of ``PROMPTS[0]`` and greedy outputs of all ``PROMPTS`` on this rank's shard
    (``tbo``: with two-batch overlap, `models.two_batch`; ``fp8``: an fp8 checkpoint's weights kept fp8)."""
    num_pages = 64
    rank = build_rank(RankSpec(str(model_dir), kv_cache_dtype=kv_cache_dtype, num_pages=num_pages,
                               two_batch_overlap=tbo, keep_fp8=fp8), tp)
    model, runner = rank.model, rank.runner
    shapes = {
        "q_b_proj rows": model.layers[0].self_attn.q_b_proj.weight.shape[0],
        "o_proj cols": model.layers[0].self_attn.o_proj.weight.shape[1],
        "experts": model.layers[1].mlp.experts.num_local,
        "first expert": model.layers[1].mlp.first_expert,
        "dense gate rows": model.layers[0].mlp.gate_proj.weight.shape[0],
        "mtp experts": model.mtp[0].decoder.mlp.experts.num_local,
        "weight dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }
    assert isinstance(model.layers[1].mlp, MoE)
    pool = PagePool(num_pages)
    pages = pool.allocate_for_tokens(len(PROMPTS[0]))
    _, hidden = runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(PROMPTS[0]), 0, tuple(pages))])
    with torch.inference_mode():
        logits = model.logits(hidden)
    pool.free(pages)
    engine = Engine(runner, pool, SchedulerConfig(max_batch_size=8, chunk_size=32, mtp_draft_tokens=mtp),
                    model.cfg.eos_token_ids)
    reqs = [Request(f"r{i}", list(p), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]
    for r in reqs:
        assert engine.add_request(r) is None
    while any(not r.finished for r in reqs):
        engine.step()
    return {"logits": logits, "outputs": [list(r.output) for r in reqs], "shapes": shapes,
            "free": pool.free_count, "mtp_drafted": engine.stats.mtp_drafted,
            "overlapped": model.two_batch.overlapped if model.two_batch is not None else 0}


def _rank_main(rank: int, world: int, port: int, model_dir: str, kv_cache_dtype: str, mtp: int, out: str,
               tbo: bool = False, fp8: bool = False) -> None:
    torch.set_num_threads(1)  # two ranks share a small CI machine
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        res = _run_replica(Path(model_dir), TPContext(rank, world, dist.group.WORLD), kv_cache_dtype, mtp, tbo, fp8)
        torch.save(res, f"{out}.{rank}")
        # Tear gloo down only once every rank is done with it. Without this, rank 0 aborted in
        # about one run in twenty on the 2-core CI machine ("terminate called without an active
        # exception"); with it, 12 of 12 runs passed (too few to rule the abort out).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_tp(model_dir: Path, world: int, kv_cache_dtype: str, mtp: int, tmp: Path, tbo: bool = False,
           fp8: bool = False) -> list[dict]:
    """Every rank's result of ``_run_replica`` with ``world`` gloo ranks in spawned processes."""
    out = str(tmp / f"tp{world}-{kv_cache_dtype}-{mtp}-{int(tbo)}-{int(fp8)}")
    mp.spawn(_rank_main, args=(world, _free_port(), str(model_dir), kv_cache_dtype, mtp, out, tbo, fp8), nprocs=world,
             join=True)
    return [torch.load(f"{out}.{r}") for r in range(world)]


# Exact caches on one arch, the serving fp8 byte formats on the other; MTP on
# (its decoder layer is sharded too) and off (plain one-token decode).
@pytest.mark.parametrize("arch,kv_cache_dtype,mtp", [("deepseek_v32", "auto", 1), ("glm_moe_dsa", "fp8", 0),
                                                     ("glm_moe_dsa", "auto", 2)])
def test_tp2_equals_tp1(arch, kv_cache_dtype, mtp, tmp_path):
    tiny = make_tiny(arch, tmp_path / arch, seed=7)
    ref = _run_replica(tiny, SINGLE, kv_cache_dtype, mtp)
    ranks = run_tp(tiny, 2, kv_cache_dtype, mtp, tmp_path)

    # Each rank holds its half: 4 of 8 heads, 4 of 8 routed experts (its own range), half the MLP columns.
    for r, res in enumerate(ranks):
        s, full = res["shapes"], ref["shapes"]
        assert s["q_b_proj rows"] * 2 == full["q_b_proj rows"]
        assert s["o_proj cols"] * 2 == full["o_proj cols"]
        assert s["dense gate rows"] * 2 == full["dense gate rows"]
        assert s["experts"] * 2 == full["experts"] == 8 and s["mtp experts"] * 2 == full["mtp experts"]
        assert s["first expert"] == 4 * r
    # Every rank computes the same logits (the all-reduce result is the same bytes everywhere) ...
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])
    assert ranks[0]["outputs"] == ranks[1]["outputs"]
    # ... and they equal one process's up to the summation order of the sharded matmuls.
    print(f"{arch} kv {kv_cache_dtype}: max |logits tp2 - tp1| = {(ranks[0]['logits'] - ref['logits']).abs().max():.2e}")
    torch.testing.assert_close(ranks[0]["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
    assert ranks[0]["outputs"] == ref["outputs"]
    assert all(len(o) == NEW_TOKENS for o in ref["outputs"])
    assert ranks[0]["free"] == ref["free"] == 64
    assert (ranks[0]["mtp_drafted"] > 0) == (mtp > 0)


def test_tp2_with_fp8_weights_equals_tp1_dequantized(tmp_path):
    """An fp8 checkpoint (16 x 16 blocks: several per projection) held in fp8 and sharded, scales with
    their rows / columns, on two ranks == one process that dequantized it on load."""
    tiny = make_tiny("deepseek_v32", tmp_path / "fp8", seed=11, fp8=True, fp8_block=(16, 16))
    ref = _run_replica(tiny, SINGLE, "auto", 1)
    ranks = run_tp(tiny, 2, "auto", 1, tmp_path, fp8=True)
    assert "torch.float8_e4m3fn" in ranks[0]["shapes"]["weight dtypes"]
    assert "torch.float8_e4m3fn" not in ref["shapes"]["weight dtypes"]
    torch.testing.assert_close(ranks[0]["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
    assert ranks[0]["outputs"] == ranks[1]["outputs"] == ref["outputs"]
    assert ranks[0]["free"] == 64


@pytest.mark.parametrize("arch,kv_cache_dtype,mtp", [("deepseek_v32", "fp8", 1), ("glm_moe_dsa", "auto", 0)])
def test_tp2_with_two_batch_overlap_equals_tp1(arch, kv_cache_dtype, mtp, tmp_path):
    """Two-batch overlap (`models.two_batch`): each multi-request forward (prefill chunks of several
    prompts, decode and MTP verify steps) runs as two micro-batches in two threads taking turns at
    their all-reduces (launched without waiting, on the model's one process group). The output is tp 2's without it: equal to one
    process's greedy output, on GLM-5 too, whose shared layers reuse top-k within each micro-batch."""
    tiny = make_tiny(arch, tmp_path / arch, seed=7)
    ref = _run_replica(tiny, SINGLE, kv_cache_dtype, mtp)
    ranks = run_tp(tiny, 2, kv_cache_dtype, mtp, tmp_path, tbo=True)
    assert all(r["overlapped"] > 0 for r in ranks), [r["overlapped"] for r in ranks]
    assert ranks[0]["overlapped"] == ranks[1]["overlapped"]  # the ranks split every forward alike
    assert ranks[0]["outputs"] == ranks[1]["outputs"] == ref["outputs"]
    torch.testing.assert_close(ranks[0]["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
    assert ranks[0]["free"] == ref["free"] == 64
    assert (ranks[0]["mtp_drafted"] > 0) == (mtp > 0)
    print(f"{arch} kv {kv_cache_dtype} mtp {mtp}: {ranks[0]['overlapped']} forwards as two micro-batches")


def test_two_batch_turns_issue_collectives_in_one_order():
    """`models.two_batch.Turns`: whatever the threads' timing, the micro-batches' all-reduces are
    issued A0, B0, A1, B1, ... (NCCL needs one issuing order on every rank), and a micro-batch with
    more of them than its partner finishes alone without waiting."""
    import random
    import threading
    import time

    from models.two_batch import Turns

    for trial in range(20):
        turns, order = Turns(), []
        rng = random.Random(trial)
        counts = (3, 5) if trial % 2 else (4, 4)

        def micro(me: int) -> None:
            turns.wait_turn(me)
            try:
                for i in range(counts[me]):
                    time.sleep(rng.random() * 1e-3)  # compute of uneven length
                    order.append(f"{'AB'[me]}{i}")
                    turns.pass_turn(me)
            finally:
                turns.done(me)

        threads = [threading.Thread(target=micro, args=(m,)) for m in (1, 0)]  # B starts first: it must wait
        for t in threads:
            t.start()
        for t in threads:
            t.join(5)
            assert not t.is_alive(), f"trial {trial}: a micro-batch never got its turn back"
        a, b = counts
        want = [x for i in range(max(a, b)) for x in ((f"A{i}",) if i < a else ()) + ((f"B{i}",) if i < b else ())]
        assert order == want, (trial, order)


def test_split_batch_keeps_every_request_whole():
    """`models.two_batch.split_batch`: two halves of requests, each with its own tokens, rows and lengths."""
    from models.batch import ForwardBatch
    from models.two_batch import split_batch, split_point

    q = torch.tensor([3, 1, 4, 2])
    T = int(q.sum())
    batch = ForwardBatch(ForwardMode.PREFILL, torch.arange(T), torch.arange(T) + 100, torch.arange(T) + 200,
                         torch.arange(8, dtype=torch.int32).view(4, 2), torch.tensor([3, 5, 4, 9]), q, max_seq_len=9)
    at = split_point(batch)
    assert at == 2  # 3 + 1 tokens of 10: about half
    a, b = split_batch(batch, at)
    assert a.input_ids.tolist() == [0, 1, 2, 3] and b.input_ids.tolist() == [4, 5, 6, 7, 8, 9]
    assert a.positions.tolist() == [100, 101, 102, 103] and b.out_slots.tolist() == [204, 205, 206, 207, 208, 209]
    assert a.page_tables.tolist() == [[0, 1], [2, 3]] and b.page_tables.tolist() == [[4, 5], [6, 7]]
    assert a.seq_lens.tolist() == [3, 5] and b.q_lens.tolist() == [4, 2] and a.max_seq_len == b.max_seq_len == 9
    one = ForwardBatch(ForwardMode.DECODE, torch.tensor([1]), torch.tensor([4]), torch.tensor([4]),
                       torch.zeros(1, 1, dtype=torch.int32), torch.tensor([5]), torch.tensor([1]))
    assert split_point(one) is None
    wide = ForwardBatch(ForwardMode.PREFILL, torch.arange(9), torch.arange(9), torch.arange(9),
                        torch.zeros(2, 1, dtype=torch.int32), torch.tensor([8, 1]), torch.tensor([8, 1]))
    assert split_point(wide) == 1  # each half keeps at least one request


def test_shard_tensor_slices_weights_and_column_biases():
    """The loader's one slicing rule: concatenating every rank's slice gives the full tensor back."""
    from models.loader import shard_tensor

    class _Group:  # a TPContext needs a group object for size > 1; slicing never touches it
        pass

    full_w, full_b = torch.randn(8, 6), torch.randn(8)
    ranks = [TPContext(r, 2, _Group()) for r in range(2)]
    col = [ColumnParallelLinear(6, 8, tp, bias=True) for tp in ranks]
    row = [RowParallelLinear(8, 6, tp, bias=True) for tp in ranks]
    col_w = [shard_tensor(m, full_w, tp) for m, tp in zip(col, ranks)]
    col_b = [shard_tensor(m, full_b, tp) for m, tp in zip(col, ranks)]
    assert col_w[0].shape == col[0].weight.shape and col_b[0].shape == col[0].bias.shape
    assert torch.equal(torch.cat(col_w, 0), full_w) and torch.equal(torch.cat(col_b), full_b)
    row_w = [shard_tensor(m, full_w.T, tp) for m, tp in zip(row, ranks)]
    assert row_w[0].shape == row[0].weight.shape and torch.equal(torch.cat(row_w, 1), full_w.T)
    bias = torch.randn(6)
    assert all(shard_tensor(m, bias, tp) is bias for m, tp in zip(row, ranks))  # added once, after the all-reduce
