"""The peer harness on CPU: the offline bench's step timeline and token ids, the greedy
agreement check, the generated serve configs, and the ratio table."""

from __future__ import annotations

import json
import re

import pytest

from bench.offline import decode_case, prefill_case, random_prompts
from bench.peers.agreement import compare, first_divergence
from bench.peers.checkpoint import dsv32_shaped_kwargs
from bench.peers.serve_config import serve_config
from bench.peers.table import load, table
from deployments.admission import ingress_replicas
from deployments.controller import check_args
from models.tiny import _config_class, make_tiny
from workers.offline import LLM
from workers.structured import GrammarSpec


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(make_tiny("deepseek_v32", tmp_path_factory.mktemp("peer-tiny"), seed=5), kv_cache_dtype="fp8",
               num_pages=64, chunk_size=64, max_batch_size=8)


def test_offline_timeline_counts_every_token_and_ids_match_generate(llm):
    c = decode_case(llm, batch=3, input_len=40, output_len=6, seed=2)
    steps = c["steps"]
    assert all(s["end_s"] >= s["start_s"] >= 0 for s in steps)
    assert all(a["end_s"] <= b["start_s"] for a, b in zip(steps, steps[1:]))  # one after the other
    assert sum(s["prefill_tokens"] for s in steps) == 3 * 40
    assert sum(s["decode_tokens"] for s in steps) == 3 * 5  # the first token of each comes from its prefill
    assert c["steady_steps"] > 0 and c["tpot_ms_median"] > 0
    assert c["token_ids"] == llm.generate(random_prompts(3, 40, 2), max_new_tokens=6, ignore_eos=True)
    p = prefill_case(llm, batch=2, length=100, seed=3)  # 100 > chunk_size: two chunks each
    assert p["prefill_tokens_per_s"] > 0 and sum(s["prefill_tokens"] for s in p["steps"]) == 200
    assert llm.pool.free_count == llm.pool.num_pages
    # BxL+C: after a cached prefix of C tokens (whole pages), the timed run computes only the new tokens.
    from attention.formats import PAGE_SIZE

    hit = prefill_case(llm, batch=2, length=30, seed=4, cached=2 * PAGE_SIZE)
    assert hit["case"] == f"prefill 2x30 over {2 * PAGE_SIZE} cached" and hit["cached_prefix"] == 2 * PAGE_SIZE
    assert sum(s["prefill_tokens"] for s in hit["steps"]) == 2 * 30
    again = prefill_case(llm, batch=1, length=30, seed=5, cached=2 * PAGE_SIZE, warm=False)  # still cached
    assert sum(s["prefill_tokens"] for s in again["steps"]) == 30
    assert llm.pool.free_count == llm.pool.num_pages


def test_prefill_case_text():
    from bench.offline import parse_prefill_case

    assert parse_prefill_case("8x4096") == (8, 4096, 0)
    assert parse_prefill_case("1X256+8192") == (1, 256, 8192)
    for bad in ("8", "8x", "0x10", "1x10+-1", "1x10+a"):
        with pytest.raises(SystemExit, match="--prefill"):
            parse_prefill_case(bad)


def test_offline_bench_command_writes_its_cases(tmp_path, capsys):
    """`dsa-pd bench offline` end to end (tp 1): every case in the JSON with the run's settings."""
    from bench.offline import main

    model = make_tiny("deepseek_v32", tmp_path / "m", seed=5)
    out = tmp_path / "o.json"
    assert main(["--model", str(model), "--prefill", "2x40", "--batch-sizes", "2", "--input-len", "20",
                 "--output-len", "6", "--chunk-size", "64", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["tp_size"] == 1 and got["two_batch_overlap"] is False and got["two_batch_forwards"] == 0
    assert [c["case"] for c in got["cases"]] == ["prefill 2x40", "decode batch 2"]
    assert got["cases"][1]["tpot_ms_median"] > 0 and len(got["cases"][1]["token_ids"]) == 2
    assert "forwards as two micro-batches: 0" in capsys.readouterr().out


def test_offline_decode_under_a_grammar(llm):
    # --grammar-regex: every decode request constrained (what a constrained batch costs is measured so).
    spec = GrammarSpec("regex", "[a-z ,.]+")
    c = decode_case(llm, batch=2, input_len=30, output_len=5, seed=4, grammar=spec)
    assert c["grammar"] == "regex:[a-z ,.]+" and c["steady_steps"] > 0
    tok = llm.engine.grammars.tokenizer
    assert all(re.fullmatch(spec.value, tok.decode(ids)) for ids in c["token_ids"]), c["token_ids"]
    assert c["token_ids"] == llm.generate(random_prompts(2, 30, 4), max_new_tokens=5, ignore_eos=True, grammar=spec)


def test_agreement_finds_the_divergence_and_a_non_negative_margin(llm):
    ours = {"cases": [decode_case(llm, batch=2, input_len=30, output_len=5, seed=1)]}
    peer = json.loads(json.dumps(ours))
    changed = ours["cases"][0]["token_ids"][1][2]
    peer["cases"][0]["token_ids"][1][2] = (changed + 1) % llm.cfg.vocab_size
    (row,) = compare(ours, peer, llm, seed=1)
    assert (row["identical"], row["requests"]) == (1, 2) and row["mean_agreed_tokens"] == (5 + 2) / 2
    # Ours is the greedy argmax over the same logits: its margin over any other token is >= 0.
    assert len(row["first_divergence_margins"]) == 1 and row["first_divergence_margins"][0] >= 0
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2 and first_divergence([1, 2], [1, 2, 3]) is None


def test_agreement_asks_transformers_at_each_divergence(llm):
    """The third opinion: transformers (fp32) at a divergence made by changing the peer's token picks ours (our
    greedy output is transformers' on this tiny model), and one made by changing ours picks the peer's."""
    from bench.peers.agreement import transformers_judge

    ours = {"cases": [decode_case(llm, batch=2, input_len=30, output_len=5, seed=1)]}
    peer = json.loads(json.dumps(ours))
    peer["cases"][0]["token_ids"][0][1] = (ours["cases"][0]["token_ids"][0][1] + 1) % llm.cfg.vocab_size
    ours["cases"][0]["token_ids"][1][3] = (peer["cases"][0]["token_ids"][1][3] + 1) % llm.cfg.vocab_size
    (row,) = compare(ours, peer, None, seed=1, judge=transformers_judge(str(llm.model_dir)))
    assert row["judge_picks"] == ["ours", "peer"] and row["first_divergence_margins"] == []


@pytest.mark.parametrize("mode", ["pd", "monolithic"])
def test_generated_serve_configs_pass_the_controller(tmp_path, mode):
    ckpt = tmp_path / "dsv32"
    _config_class("deepseek_v32")(**dsv32_shaped_kwargs(4, 16)).save_pretrained(ckpt)
    doc = serve_config(ckpt, mode, gpu_memory_gib=80)
    res = check_args(doc["applications"][0]["args"])
    assert res.ok, [str(v) for v in res.violations]
    assert res.app_cfg.features.prefix_caching
    off = check_args(serve_config(ckpt, mode, gpu_memory_gib=80, prefix_caching=False)["applications"][0]["args"])
    assert off.ok and not off.app_cfg.features.prefix_caching
    ab = check_args(serve_config(ckpt, mode, gpu_memory_gib=80, engine_process=True,
                                 gil_switch_interval_ms=5.0)["applications"][0]["args"])
    roles = [ab.app_cfg.decode] + ([ab.app_cfg.prefill] if mode == "pd" else [])
    assert ab.ok and all(r.engine_process and r.gil_switch_interval_ms == 5.0 for r in roles)
    # The default (cuda, one rank): the engine in a process of its own; ENGINE_PROCESS=0's baseline turns it off.
    assert res.app_cfg.decode.engine_process is None and res.app_cfg.decode.runs_engine_process
    assert res.app_cfg.decode.gil_switch_interval_ms == 0.2
    thread = check_args(serve_config(ckpt, mode, gpu_memory_gib=80, engine_process=False)["applications"][0]["args"])
    assert thread.ok and not thread.app_cfg.decode.runs_engine_process
    out = check_args(serve_config(ckpt, mode, gpu_memory_gib=80, ingress_replicas=3,
                                  stream_items_per_s=500)["applications"][0]["args"])
    assert out.ok and out.app_cfg.ingress.num_replicas == 3 and out.app_cfg.decode.stream_items_per_s == 500
    # 128 decode streams: four ingress replicas by default (deployments.admission.ingress_replicas).
    assert ingress_replicas(res.app_cfg) == 4 and res.app_cfg.decode.stream_items_per_s == 2000


def test_table_divides_by_the_peer(tmp_path):
    def doc(tok_s, tpot):
        return {"output_throughput": tok_s, "median_ttft_ms": 10.0, "median_tpot_ms": tpot, "failed": 0,
                "requested_output_lens": [256]}

    for engine, tok_s, tpot in (("vllm", 1000.0, 2.0), ("dsa-mono", 500.0, 4.0)):
        (tmp_path / f"{engine}__bf16__in1024__c32.json").write_text(json.dumps(doc(tok_s, tpot)))
    md = table(load(tmp_path), ["vllm", "dsa-mono"])
    row = md.splitlines()[2].split(" | ")
    assert row[:3] == ["| bf16", "1024/256", "32"] and row[-3:-1] == ["0.50", "2.00"]


def test_cases_of_one_seed_share_no_prefix():
    """Cases of one run draw from one seed: none may start with another's tokens (the prefix cache
    would serve the later one, and it would not time the prefill it names)."""
    long, short = random_prompts(1, 1024, 1)[0], random_prompts(1, 512, 1)[0]
    assert long[:64] != short[:64]
    small, big = random_prompts(32, 64, 1), random_prompts(128, 64, 1)
    assert not {tuple(p[:16]) for p in small} & {tuple(p[:16]) for p in big}
    assert random_prompts(2, 40, 3) == random_prompts(2, 40, 3)  # still a function of its arguments
