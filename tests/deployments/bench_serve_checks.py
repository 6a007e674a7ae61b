"""`dsa-pd bench serve` against `serve run configs/tiny_pd.yaml`: tests collected by
tests/deployments/test_serve_app.py, which imports them to run on its server (``ready``: one
server start less in CI).

Checked: a random token-id workload completes with the counts and lengths the
server generated (each request replayed non-streamed, independently of the
bench, must give the same completion tokens and text); TTFT <= E2E latency; a
prompt over the model's max_model_len is a failed request carrying the
server's 400 message, not a crash.
"""

from __future__ import annotations

import json

import httpx
import pytest

from bench.serve.datasets import random_requests
from deployments.cli import main


def bench(url: str, out_dir, *extra: str) -> tuple[int, dict]:
    code = main(["bench", "serve", "--base-url", url, "--save-result", "--result-dir", str(out_dir),
                 "--result-filename", "result.json", "--disable-tqdm", *extra])
    return code, json.loads((out_dir / "result.json").read_text())


def test_random_workload_counts_what_the_server_generated(ready, tmp_path, capsys):
    code, doc = bench(ready.url, tmp_path, "--num-prompts", "6", "--random-input-len", "28",
                      "--random-range-ratio", "0.42", "--random-output-len", "8", "--max-concurrency", "3",
                      "--ignore-eos", "--temperature", "0", "--seed", "5", "--num-warmups", "1",
                      "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
                      "--goodput", "e2el:600000")
    assert code == 0
    assert (doc["completed"], doc["failed"], doc["errors"]) == (6, 0, [""] * 6)
    # The same seed makes the same requests here, independently of the run.
    reqs = random_requests(6, 28, 8, 0.42, vocab_size=256, token_offset=0, seed=5)
    assert all(16 <= len(q.prompt) <= 39 and 4 <= q.output_len <= 11 for q in reqs)
    assert doc["input_lens"] == [len(q.prompt) for q in reqs]  # the server's usage.prompt_tokens
    assert doc["output_lens_from_usage"] == [True] * 6
    # ignore_eos: every request ran to its max_tokens.
    assert doc["output_lens"] == doc["requested_output_lens"] == [q.output_len for q in reqs]
    assert doc["total_output_tokens"] == sum(q.output_len for q in reqs)
    # Replayed without streaming (greedy is deterministic): the same tokens and text.
    for q, text, n in zip(reqs, doc["generated_texts"], doc["output_lens"]):
        r = httpx.post(ready.url + "/v1/completions", timeout=120, json={
            "model": doc["model_id"], "prompt": q.prompt, "max_tokens": q.output_len, "temperature": 0,
            "ignore_eos": True}).json()
        assert (r["usage"]["completion_tokens"], r["choices"][0]["text"]) == (n, text)
    for ttft, e2el, itl, n in zip(doc["ttfts"], doc["e2els"], doc["itls"], doc["output_lens"]):
        assert 0 < ttft <= e2el and len(itl) <= n - 1 and ttft + sum(itl) <= e2el
    assert doc["tpots"] == [pytest.approx((e - t) / (n - 1)) for t, e, n in
                            zip(doc["ttfts"], doc["e2els"], doc["output_lens"])]
    assert doc["request_goodput"] == pytest.approx(doc["request_throughput"])
    assert doc["mean_ttft_ms"] > 0 and doc["p99_e2el_ms"] >= doc["p50_e2el_ms"] > 0
    table = capsys.readouterr().out
    assert "Successful requests:                     6" in table and "P90 ITL (ms):" in table


def test_a_prompt_over_max_model_len_is_a_failed_request(ready, tmp_path, capsys):
    model = httpx.get(ready.url + "/v1/models").json()["data"][0]
    too_long = [7] * model["max_model_len"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in (
        {"prompt": [1, 2, 3, 4], "output_len": 3}, {"prompt": too_long, "output_len": 2},
        {"prompt": "Sparse attention is", "output_len": 2})))
    code, doc = bench(ready.url, tmp_path, "--dataset-name", "jsonl", "--dataset-path", str(path),
                      "--ignore-eos", "--max-concurrency", "2")
    assert code == 0
    assert (doc["completed"], doc["failed"], doc["successes"]) == (2, 1, [True, False, True])
    # The server's own answer to that request, asked directly.
    direct = httpx.post(ready.url + "/v1/completions", timeout=60, json={
        "model": model["id"], "prompt": too_long, "max_tokens": 2})
    assert direct.status_code == 400
    assert doc["errors"] == ["", f"HTTP 400: {direct.json()['error']['message']}", ""]
    assert doc["output_lens"] == [3, 0, 2] and doc["ttfts"][1] is None
    assert doc["input_lens"][0] == 4 and doc["input_lens"][2] > 0  # the text prompt's count is the server's
    assert doc["total_input_tokens"] == doc["input_lens"][0] + doc["input_lens"][2]
    out = capsys.readouterr().out
    assert "Failed requests:                         1" in out and "#1: HTTP 400:" in out
