"""`bench serve` against a fake OpenAI server (an httpx mock transport, no
network): SSE parsing and timing, multi-token chunks, every failure kind,
concurrency limit, warm-ups and the saved JSON, through `dsa-pd bench serve`'s parser."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from bench.serve.cli import add_arguments, run_benchmark
from bench.serve.client import error_message, send_request


def sse(*events) -> list[bytes]:
    return [f"data: {json.dumps(e) if not isinstance(e, str) else e}\n\n".encode() for e in events]


def chunk(text, finish=None):
    return {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


USAGE = {"id": "c", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}


def streaming(events: list[bytes], gap_s: float = 0.0):
    async def body():
        for e in events:
            if gap_s:
                await asyncio.sleep(gap_s)
            yield e
    return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})


async def one(handler, body=None, chat=False, prompt_len=None):
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        return await send_request(http, "http://x/v1/completions", body or {"prompt": [1]}, chat=chat,
                                  prompt_len=prompt_len)


def test_multi_token_chunks_take_the_token_count_from_usage():
    # 3 content chunks carrying 7 tokens (as with MTP), then usage, then [DONE].
    events = sse(chunk("ab"), chunk("cde"), chunk("fg", "length"), USAGE, "[DONE]")
    r = asyncio.run(one(lambda req: streaming(events, gap_s=0.02)))
    assert r.success and r.error == "" and r.generated_text == "abcdefg"
    assert (r.output_tokens, r.output_tokens_from_usage, r.prompt_tokens) == (7, True, 5)
    assert len(r.itl) == 2 and all(g >= 0.015 for g in r.itl)
    assert 0 < r.ttft <= r.e2el and r.ttft + sum(r.itl) <= r.e2el
    assert r.tpot == pytest.approx((r.e2el - r.ttft) / 6)


def test_without_usage_tokens_are_counted_as_chunks_and_role_chunks_are_not_content():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    content = [{"choices": [{"index": 0, "delta": {"content": t}, "finish_reason": f}]} for t, f in
               (("Hi", None), (" there", None), ("", "stop"))]
    r = asyncio.run(one(lambda req: streaming(sse(role, *content, "[DONE]")), chat=True, prompt_len=None))
    # The finish chunk (empty text) counts: a server may send held-back tokens with it.
    assert r.success and (r.output_tokens, r.output_tokens_from_usage) == (3, False)
    assert r.generated_text == "Hi there" and len(r.itl) == 2 and r.prompt_tokens is None


def test_failures_are_results_with_their_error_text():
    body = {"error": {"message": "prompt has 5000 tokens; max_model_len is 2048", "type": "invalid_request_error",
                      "param": "prompt", "code": "context_length_exceeded"}}
    r = asyncio.run(one(lambda req: httpx.Response(400, json=body), prompt_len=5000))
    assert not r.success and r.error == "HTTP 400: prompt has 5000 tokens; max_model_len is 2048"
    assert r.ttft is None and r.tpot is None

    r = asyncio.run(one(lambda req: streaming(sse(chunk("a"), {"error": {"message": "transfer failed"}}))))
    assert not r.success and r.error == "error event in the stream: transfer failed"

    def refuse(req):
        raise httpx.ConnectError("connection refused", request=req)
    r = asyncio.run(one(refuse))
    assert not r.success and r.error == "ConnectError: connection refused"

    r = asyncio.run(one(lambda req: streaming(sse(chunk("a")))))  # cut off: no finish, no [DONE]
    assert not r.success and "ended before [DONE]" in r.error
    r = asyncio.run(one(lambda req: streaming(sse(USAGE, "[DONE]"))))
    assert not r.success and "no content chunk" in r.error
    assert error_message(503, b"upstream down") == "HTTP 503: upstream down"
    assert error_message(400, b'{"object": "error", "message": "bad"}') == "HTTP 400: bad"  # vLLM's shape


class FakeServer:
    """Answers /v1/models and streamed completions: ``max_tokens`` tokens, two per chunk
    (``gap_s`` apart), usage at the end; prompts longer than 50 tokens get a 400. Counts
    requests in flight."""

    def __init__(self, gap_s=0.01):
        self.gap_s, self.in_flight, self.peak, self.bodies = gap_s, 0, 0, []

    async def __call__(self, req: httpx.Request) -> httpx.Response:
        if req.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        assert req.url.path == "/v1/completions"
        body = json.loads(req.content)
        self.bodies.append(body)
        if len(body["prompt"]) > 50:
            return httpx.Response(400, json={"error": {"message": "too long", "type": "invalid_request_error"}})
        n, srv = body["max_tokens"], self

        async def stream():
            srv.in_flight += 1
            srv.peak = max(srv.peak, srv.in_flight)
            for i in range(0, n, 2):
                await asyncio.sleep(srv.gap_s)
                yield sse(chunk("t" * min(2, n - i), "length" if i + 2 >= n else None))[0]
            srv.in_flight -= 1  # before the last bytes: the client may not read past [DONE]
            yield b"".join(sse({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                                         "completion_tokens": n}}, "[DONE]"))
        return httpx.Response(200, content=stream())


def parse(argv):
    import argparse

    return add_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_run_limits_concurrency_warms_up_and_saves_json(tmp_path, capsys):
    server = FakeServer()
    args = parse(["--base-url", "http://fake:1/v1", "--num-prompts", "8", "--random-input-len", "20",
                  "--random-output-len", "6", "--random-range-ratio", "0.5", "--max-concurrency", "3",
                  "--num-warmups", "2", "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
                  "--metric-percentiles", "50,90,99", "--goodput", "ttft:10000", "tpot:10000",
                  "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json", "--disable-tqdm"])
    before = time.time()
    _summary, doc = asyncio.run(run_benchmark(args, transport=httpx.MockTransport(server)))
    after = time.time()
    assert server.peak == 3  # never more than --max-concurrency in flight
    assert len(server.bodies) == 8 + 2  # 2 warm-ups, then the timed 8
    # The warm-ups' prompts are their own: none is a timed prompt (a prefix cache would serve it as a hit).
    timed = [q["prompt"] for q in server.bodies[2:]]
    assert all(w["prompt"] not in timed and w["prompt"][:4] not in [t[:4] for t in timed] for w in server.bodies[:2])
    b = server.bodies[-1]
    assert b["model"] == "fake-model" and b["stream"] and b["stream_options"] == {"include_usage": True}
    assert b["ignore_eos"] is True and b["temperature"] == 0.0 and isinstance(b["prompt"], list)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved == json.loads(json.dumps(doc))
    assert saved["completed"] == 8 and saved["failed"] == 0 and saved["num_prompts"] == 8
    assert saved["output_lens"] == saved["requested_output_lens"] == [q["max_tokens"] for q in server.bodies[2:]]
    assert saved["input_lens"] == [len(q["prompt"]) for q in server.bodies[2:]]
    assert saved["total_output_tokens"] == sum(saved["output_lens"])
    assert all(t <= e for t, e in zip(saved["ttfts"], saved["e2els"]))
    # The first timed request's wall clock (after the warm-ups): start_times are offsets from it.
    assert before < saved["started_at"] < after and min(saved["start_times"]) == 0
    assert saved["started_at"] + max(saved["start_times"]) < after
    assert [len(g) for g in saved["itls"]] == [(n + 1) // 2 - 1 for n in saved["output_lens"]]
    assert saved["request_goodput"] == pytest.approx(saved["request_throughput"])
    for key in ("p50_ttft_ms", "p90_tpot_ms", "p99_itl_ms", "median_e2el_ms", "std_e2el_ms"):
        assert saved[key] is not None and saved[key] >= 0
    assert saved["config"]["max_concurrency"] == 3 and saved["request_rate"] == "inf"
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "P90 TPOT (ms):" in out and "Request goodput (req/s):" in out


def test_a_failing_request_is_counted_not_fatal(tmp_path):
    lines = [{"prompt": [1] * 10, "output_len": 4}, {"prompt": [2] * 80, "output_len": 4}, {"prompt": [3] * 5}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = parse(["--model", "m", "--dataset-name", "jsonl", "--dataset-path", str(path), "--random-output-len", "2",
                  "--request-rate", "50", "--disable-tqdm"])
    t = time.perf_counter()
    summary, doc = asyncio.run(run_benchmark(args, transport=httpx.MockTransport(FakeServer())))
    assert time.perf_counter() - t < 30
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert doc["successes"] == [True, False, True] and doc["errors"] == ["", "HTTP 400: too long", ""]
    assert doc["output_lens"] == [4, 0, 2] and doc["ttfts"][1] is None


def test_bench_serve_is_a_dsa_pd_subcommand(capsys):
    from deployments.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--base-url", "--endpoint", "--dataset-name", "--random-range-ratio", "--request-rate",
                 "--max-concurrency", "--goodput", "--save-result", "--num-warmups", "--random-vocab-size"):
        assert flag in help_text
    # Bad arguments are the user's to fix: exit 2 with a message, before any request.
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--percentile-metrics", "ttft,foo"]) == 2
    assert "--percentile-metrics" in capsys.readouterr().err


def test_unicode_line_breaks_inside_an_event_do_not_split_it():
    # vLLM sends generated text raw: U+2028 / U+0085 inside a JSON string are not SSE line ends.
    raw = 'data: {"choices": [{"index": 0, "text": "a\u2028b\x85c", "finish_reason": "length"}]}\n\n'
    events = [raw.encode(), *sse(USAGE, "[DONE]")]
    r = asyncio.run(one(lambda req: streaming(events)))
    assert r.success and r.generated_text == "a\u2028b\x85c", r.error
