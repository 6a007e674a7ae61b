"""`serve run configs/tiny_pd.yaml` end to end, with the official `openai` client.

One server (a fresh local Ray cluster on this machine: ingress, decode,
prefill and directory replicas, NIXL between the two roles), shared with
test_prometheus_dashboards.py (tests/deployments/shared_servers.py). The
reference is the offline engine, `LLM(model_dir, pd=False)`, on the tiny model
of the same spec (made once for the servers and the references of a run),
with the same dtype and KV format as the config. Checked: greedy output of
completions and chat, streamed and not, equals the reference for the same
prompt token ids, also under concurrent clients; every refused request gets
its OpenAI error object and status; a client leaving mid-stream (or a
non-streamed request timing out) frees its pages on both sides; and
`dsa-pd bench serve` against it (tests/deployments/bench_serve_checks.py).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import yaml

from deployments.app_config import AppConfig
from tests.deployments import bench_payloads as bp
from tests.deployments.app_fixtures import CONFIGS
from tests.deployments.logprob_checks import (
    check_chat_logprobs,
    check_echo_logprobs,
    check_lm_eval,
    join_chunks,
    run_lm_eval,
    sse_events,
)
from tests.deployments.offline_reference import Reference, prompt_ids, reference_llm
from tests.deployments.serve_process import stats, wait_until
from tests.deployments.shared_servers import TINY_PD, server_fixture

pytestmark = pytest.mark.slow

CONFIG = CONFIGS / "tiny_pd.yaml"
ARGS = AppConfig.model_validate(yaml.safe_load(CONFIG.read_text())["applications"][0]["args"])
MODEL = ARGS.model_name


SERVER = TINY_PD
server = server_fixture(SERVER)


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]
TEXT_PROMPT = "Sparse attention is"
# Prompts whose offline greedy continuations the tests compare against (token-id prompts; the
# text and chat prompts are tokenized in the fixture, as the ingress does).
ID_PROMPTS = {
    "n1": prompt_ids(1, seed=1), "n70": prompt_ids(70, seed=70), "n300": prompt_ids(300, seed=300),
    "stream": prompt_ids(130, seed=7),
    **{f"conc{i}": prompt_ids(20 + 37 * i, seed=100 + i) for i in range(6)},
}


@pytest.fixture(scope="module")
def reference(server):
    """Computed while the server starts (both take CPU-minutes on a small machine), when this
    module is its first user."""
    with reference_llm(ARGS) as (llm, tok, _):
        chat = tok(tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"]
        yield Reference(llm, tok, {**ID_PROMPTS, "text": tok(TEXT_PROMPT)["input_ids"], "chat": chat})


@pytest.fixture(scope="module")
def ready(server, reference):
    server.wait_ready(timeout=240)
    return server


@pytest.fixture(scope="module")
def client(ready):
    return openai.OpenAI(base_url=ready.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def free_pages(server) -> tuple[int, int]:
    s = stats(server)
    return s["prefill"][0]["stats"]["free_pages"], s["decode"][0]["stats"]["free_pages"]


def whole_pools(server, timeout_s: float = 20.0) -> tuple[int, int]:
    """(prefill, decode) free pages once every earlier request has ended: every page but decode's
    warm-up page. A client's call returns before its pages are back (decode frees them after the
    last token), so a count taken right after another test would not be the idle one."""
    whole = (ARGS.prefill.num_pages, ARGS.decode.num_pages - 1)
    wait_until(lambda: free_pages(server) == whole, timeout_s, "pools at their start counts")
    return whole


# --------------------------------------------------------------------------- happy paths


def test_health_models_and_stats(ready, client):
    assert httpx.get(ready.url + "/health").json()["status"] == "ok"
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    s = stats(ready)
    (pre,), (dec,) = s["prefill"], s["decode"]
    assert pre["stats"]["known_decodes"] == 1 and dec["stats"]["known_prefills"] == 1
    assert pre["stats"]["free_pages"] == ARGS.prefill.num_pages
    # One decode page is set aside for prefill's warm-up WRITE.
    assert dec["stats"]["free_pages"] == ARGS.decode.num_pages - 1


@pytest.mark.parametrize("name", ["n1", "n70", "n300"])
def test_completion_equals_offline_greedy(client, reference, name):
    ids = reference.prompts[name]
    text, count, finish = reference.expect(name, 12)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == (text, count, finish)
    assert r.usage.prompt_tokens == len(ids) and r.model == MODEL and r.object == "text_completion"


def test_streamed_completion_equals_non_streamed(client, reference):
    ids = reference.prompts["stream"]
    text, count, _ = reference.expect("stream", 32, ignore_eos=True)
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=32, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == count == 32 and chunks[-1].usage.prompt_tokens == len(ids)


def test_text_prompt_and_stop_string(client, reference):
    text, _, _ = reference.expect("text", 24, ignore_eos=True)
    kw = dict(model=MODEL, prompt=TEXT_PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert (r.choices[0].text, r.usage.prompt_tokens) == (text, len(reference.prompts["text"]))
    # A stop string from the expected text, made of characters no special token has (the
    # engine matches stop strings on text that still holds special tokens).
    special = set("".join(reference.tok.all_special_tokens))
    stop = next(c for c in text[4:] if c.isascii() and c.isprintable() and c not in special)
    cut = text[: text.index(stop)]
    r = client.completions.create(**kw, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    assert "".join(c.choices[0].text for c in client.completions.create(**kw, stop=stop, stream=True)) == cut


def test_chat_streamed_and_not_equal_offline(client, reference):
    text, count, _ = reference.expect("chat", 16, ignore_eos=True)
    kw = dict(model=MODEL, messages=CHAT, temperature=0, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw, max_tokens=16)
    assert (r.choices[0].message.role, r.choices[0].message.content) == ("assistant", text)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(reference.prompts["chat"]), count)
    chunks = list(client.chat.completions.create(**kw, max_completion_tokens=16, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_return_token_ids_are_the_engines(client, reference):
    """vLLM's ``return_token_ids``: the prompt's and the output's ids beside the text (what the peer
    harness' greedy agreement reads), streamed and not, completions and chat; absent unless asked."""
    ids, want = reference.prompts["n70"], reference.out["n70"][:10]
    kw = dict(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    asked = {"ignore_eos": True, "return_token_ids": True}
    r = client.completions.create(**kw, extra_body=asked).model_dump()
    assert (r["choices"][0]["token_ids"], r["choices"][0]["prompt_token_ids"]) == (want, ids)
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True}).model_dump()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    chunks = [c.model_dump() for c in client.completions.create(**kw, extra_body=asked, stream=True)]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want
    assert chunks[0]["choices"][0]["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    chat_want = reference.out["chat"][:8]
    ckw = dict(model=MODEL, messages=CHAT, temperature=0, max_tokens=8,
               extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.chat.completions.create(**ckw).model_dump()
    assert (r["choices"][0]["token_ids"], r["prompt_token_ids"]) == (chat_want, reference.prompts["chat"])
    chunks = [c.model_dump() for c in client.chat.completions.create(**ckw, stream=True)]
    assert chunks[0]["prompt_token_ids"] == reference.prompts["chat"]
    assert [t for c in chunks for t in (c["choices"][0].get("token_ids") or [])] == chat_want


def test_served_greedy_agrees_with_the_offline_engine(ready, reference):
    """The peer harness' served greedy client (bench/peers/served_greedy.py): its prompts sent
    concurrently, the ids the server returns, and the agreement that pairs them with another engine's
    (here the offline engine's own greedy ids: every request identical)."""
    import asyncio

    from bench.offline import random_prompts
    from bench.peers.agreement import compare
    from bench.peers.served_greedy import greedy_cases

    served = asyncio.run(greedy_cases(ready.url, MODEL, [1, 3], input_len=40, output_len=6, seed=4))
    offline = [{"batch": b, "input_len": 40, "output_len": 6,
                "token_ids": reference.llm.generate(random_prompts(b, 40, 4), max_new_tokens=6, ignore_eos=True)}
               for b in (1, 3)]
    rows = compare({"cases": offline}, {"cases": served}, seed=4)
    assert [(r["batch"], r["identical"], r["requests"]) for r in rows] == [(1, 1, 1), (3, 3, 3)]


def test_logprobs_are_the_engines(client, reference):
    ids = reference.prompts["n70"]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == 4 and all(x <= 0 for x in lp.token_logprobs)
    # Greedy: the first token is the argmax after the prompt, so its logprob is the distribution's max.
    first = reference.llm.prompt_logits(ids)[-1].log_softmax(-1).max().item()
    assert abs(lp.token_logprobs[0] - first) < 1e-3


def test_concurrent_clients(client, reference):
    jobs = [(f"conc{i}", 8 + 2 * i, i % 2 == 0) for i in range(6)]

    def run(job):
        name, m, stream = job
        r = client.completions.create(model=MODEL, prompt=reference.prompts[name], max_tokens=m, temperature=0,
                                      stream=stream, extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in r) if stream else r.choices[0].text

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(run, jobs))
    assert got == [reference.expect(name, m, ignore_eos=True)[0] for name, m, _ in jobs]


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt=prompt_ids(30, seed=5), max_tokens=10, temperature=0.9, seed=1234,
              extra_body={"top_k": 50, "ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens == 10


# --------------------------------------------------------------------------- logprobs


def test_echo_and_logprobs_equal_the_offline_engine(client, reference):
    """The prompt's logprobs come from the prefill replica's pass (two 256-token chunks), travel to
    decode with token 1 and out with the first output; the output's from decode's steps."""
    ids = reference.prompts["n300"]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, echo=True, logprobs=3,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    check_echo_logprobs(c.text, c.logprobs.model_dump(), reference.llm, reference.tok, ids, 4, 3)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 4)


def test_chat_logprobs_with_top_logprobs(client, reference):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True})
    content = client.chat.completions.create(**kw).choices[0].logprobs.content
    check_chat_logprobs(content, reference.llm, reference.tok, reference.prompts["chat"], 6, 2)
    streamed = [t for c in client.chat.completions.create(**kw, stream=True) if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in content]


def test_vllm_bench_serve_with_logprobs(ready, reference):
    """``vllm bench serve --logprobs 5``'s body (streamed): the text as without, 5 alternatives + the chosen."""
    body = bp.vllm_completions(MODEL, reference.prompts["n70"], 8, logprobs=5, extra_body=bp.VLLM_SAMPLING_FLAGS)
    events = sse_events(httpx.post(ready.url + "/v1/completions", json=body, timeout=120).raise_for_status())
    text, lp = join_chunks(events)
    assert text == reference.expect("n70", 8, ignore_eos=True)[0]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 8 and events[-1]["usage"]["completion_tokens"] == 8
    assert all(5 <= len(top) <= 6 and max(top.values()) == lp["token_logprobs"][i]  # greedy: chosen = top 1
               for i, top in enumerate(lp["top_logprobs"]))


def test_lm_eval_local_completions_loglikelihoods_equal_the_offline_engine(ready, reference, tmp_path):
    samples = run_lm_eval(ready.url, MODEL, reference.tok.name_or_path, tmp_path)
    check_lm_eval(samples, reference.llm, reference.tok)


# --------------------------------------------------------------------------- errors


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


def test_invalid_json_and_bodies(ready):
    r = httpx.post(ready.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and _error(r)["type"] == "invalid_request_error"
    assert "not valid JSON" in _error(r)["message"]
    r = httpx.post(ready.url + "/v1/chat/completions", json=[1, 2])
    assert r.status_code == 400 and "JSON object" in _error(r)["message"]
    r = httpx.post(ready.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "beam_width": 3})
    assert r.status_code == 400 and "Unrecognized request argument" in _error(r)["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-5", prompt="hi", max_tokens=2)
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}])


def test_context_limit(client, ready):
    limit = httpx.get(ready.url + "/v1/models").json()["data"][0]["max_model_len"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt_ids(limit, seed=1), max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt_ids(limit - 10, seed=1), max_tokens=20)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * limit}])
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "messages"


@pytest.mark.parametrize("field, value, needle", [
    ("temperature", 2.5, "temperature"),
    ("temperature", -1, "temperature"),
    ("top_p", 0, "top_p"),
    ("max_tokens", 0, "max_tokens"),
    ("n", 2, "n must be 1"),
    ("presence_penalty", 2.5, "presence_penalty"),
    ("logprobs", 21, "less than or equal to 20"),
])
def test_bad_sampling_values_are_400(client, field, value, needle):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", **{field: value})
    assert e.value.status_code == 400 and needle in e.value.body["message"]
    assert e.value.body["type"] == "invalid_request_error"


def test_token_ids_outside_the_vocabulary_are_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[1, 2, 10**6], max_tokens=2)
    assert "out of the vocabulary" in e.value.body["message"]


# --------------------------------------------------------------------------- disconnects


def test_client_disconnect_mid_stream_frees_pages_on_both_sides(ready):
    base = whole_pools(ready)
    body = {"model": MODEL, "prompt": prompt_ids(200, seed=9), "max_tokens": 1500, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", ready.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            events = [line for line, _ in zip((x for x in lines if x.startswith("data:")), range(10))]
            assert len(events) == 10 and json.loads(events[0][5:])["choices"][0]["text"] is not None
            # Still streaming: decode holds the request's pages (prefill already freed its own).
            busy = wait_until(lambda: (s := stats(ready))["decode"][0]["stats"]["running"] == 1 and s, 10,
                              "the request running in decode")
            assert busy["decode"][0]["stats"]["free_pages"] < base[1]
        # Leaving the `with` closes the connection mid-stream.
    wait_until(lambda: free_pages(ready) == base, 20, "pages back to their start counts")
    assert stats(ready)["decode"][0]["stats"]["running"] == 0


@pytest.mark.parametrize("prompt_len, max_tokens, timeout", [(150, 1500, 3.0), (1900, 100, 0.5)])
def test_client_timeout_of_a_non_streamed_request_frees_pages(ready, prompt_len, max_tokens, timeout):
    # 3 s: the client leaves while decode streams; 0.5 s with a long prompt: while
    # prefill computes and pushes (the decode replica cancels its prefill call).
    base = whole_pools(ready)
    body = {"model": MODEL, "prompt": prompt_ids(prompt_len, seed=11), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(ready.url + "/v1/completions", json=body, timeout=timeout)
    wait_until(lambda: free_pages(ready) == base, 30, "pages back to their start counts")


def test_a_repeated_prompt_is_served_from_both_prefix_caches(ready, client, reference):
    # "n300" ran above (test_completion_equals_offline_greedy): its 4 full pages before the last
    # token are cached on both sides now (the chain keys cover a page's next token too).
    def hits():
        s = stats(ready)
        return s["prefill"][0]["stats"]["prefix_hits"], s["decode"][0]["stats"]["prefix_hits"]

    before = hits()
    ids = reference.prompts["n300"]
    text, count, finish = reference.expect("n300", 12)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == (text, count, finish)
    # Decode kept the pages: nothing was pushed for them (the replicas' snapshots lag a step).
    wait_until(lambda: hits()[1] - before[1] >= 4 * 64, 10, f"decode prefix hits from {before}")


def test_pools_end_where_they_started(ready, client):
    # After every test above (finishes, stops, disconnects, refusals) both pools are whole again.
    client.completions.create(model=MODEL, prompt="last", max_tokens=3)
    whole_pools(ready, timeout_s=10)
    s = stats(ready)["decode"][0]["stats"]
    assert s["decode_tokens"] > 0 and s["awaiting_kv"] == 0 and s["queued"] == 0


def test_metrics_on_rays_prometheus_endpoint(ready):
    # Exported by the replicas through ray.serve.metrics; Ray's agent flushes every few seconds.
    def scraped():
        text = ready.metrics()
        names = ("ray_dsa_pd_generated_tokens_total", "ray_dsa_pd_decode_ttft_seconds_count",
                 "ray_dsa_pd_request_ttft_seconds_count", "ray_dsa_pd_request_itl_seconds_count",
                 "ray_dsa_pd_mtp_draft_tokens_total", "ray_dsa_pd_kv_push_bytes_total",
                 "ray_dsa_pd_kv_push_tail_seconds_count", 'ray_dsa_pd_kv_pushes_total{',
                 "ray_dsa_pd_prefix_cache_hits_total")
        pools = [f'ray_dsa_pd_{g}{{' for g in ("pages_used", "queue_depth")]
        return all(n in text for n in names + tuple(pools)) and 'role="prefill"' in text and text
    text = wait_until(scraped, 60, "dsa-pd series on Ray's metrics endpoint")
    tokens = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("ray_dsa_pd_generated_tokens_total{")]
    assert sum(tokens) > 0
    pushed = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("ray_dsa_pd_kv_push_bytes_total{")]
    done = [line for line in text.splitlines() if line.startswith("ray_dsa_pd_kv_pushes_total{") and 'status="done"' in line]
    assert sum(pushed) > 0 and done


# `dsa-pd bench serve` against this module's server, collected here and run last (one server start
# less in CI than a module of its own).
from tests.deployments.bench_serve_checks import (  # noqa: F401
    test_a_prompt_over_max_model_len_is_a_failed_request,
    test_random_workload_counts_what_the_server_generated,
)
