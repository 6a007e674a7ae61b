"""`serve run configs/tiny_mono.yaml` (monolithic mode) end to end, with the official `openai` client.

One server per module (a fresh local Ray cluster: ingress, directory and one decode replica
that prefills its own requests; no prefill deployment, no NIXL agent). The reference is the
offline engine, `LLM(model_dir, pd=False)`, with the decode section's dtype, KV format, chunk
size and batch size, on the tiny model of the same spec. Checked: `/health` is ok
with a decode replica alone and `/stats` lists decode replicas only; greedy output of
concurrent clients equals the reference token for token; streamed equals non-streamed; a
prompt over the context limit gets the OpenAI error; a client leaving mid-stream frees its
pages; after every test the page pool is back at its start count; the decode metrics are
exported.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import yaml

from deployments.app_config import AppConfig
from tests.deployments.app_fixtures import CONFIGS
from tests.deployments.logprob_checks import check_echo_logprobs, join_chunks, sse_events
from tests.deployments.serve_process import stats, wait_until
from tests.deployments.shared_servers import ServerSpec, server_fixture
from tests.deployments.offline_reference import Reference, prompt_ids, reference_llm

pytestmark = pytest.mark.slow

CONFIG = CONFIGS / "tiny_mono.yaml"
ARGS = AppConfig.model_validate(yaml.safe_load(CONFIG.read_text())["applications"][0]["args"])
MODEL = ARGS.model_name
POOL = ARGS.decode.num_pages  # no warm-up page: no prefill peer writes into this replica

# n300: two 256-token prefill chunks.
ID_PROMPTS = {
    "stream": prompt_ids(130, seed=17),
    **{f"conc{i}": prompt_ids([1, 20, 64, 65, 140, 300][i], seed=200 + i) for i in range(6)},
}


SERVER = ServerSpec("serve-mono", config=CONFIG)
server = server_fixture(SERVER)


@pytest.fixture(scope="module")
def reference(server):
    """Computed while the server starts, with the decode section's pool, chunk and batch sizes."""
    d = ARGS.decode
    with reference_llm(ARGS, num_pages=d.num_pages, chunk_size=d.chunk_size,
                       max_batch_size=d.max_batch_size, pd=False) as (llm, tok, _):
        yield Reference(llm, tok, ID_PROMPTS)


@pytest.fixture(scope="module")
def ready(server, reference):
    server.wait_ready(timeout=240)
    return server


@pytest.fixture(scope="module")
def client(ready):
    return openai.OpenAI(base_url=ready.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def decode_stats(server) -> dict:
    (entry,) = stats(server)["decode"]
    return entry["stats"]


def whole_pool(server, timeout_s: float = 20.0) -> None:
    """Until every earlier request has ended and given its pages back (decode frees them after
    the last token, which a client may see first)."""
    wait_until(lambda: (s := decode_stats(server))["free_pages"] == POOL and s["requests"] == 0, timeout_s,
               "the decode pool at its start count")


def test_health_and_stats_show_decode_replicas_only(ready, client):
    health = httpx.get(ready.url + "/health").json()
    assert health == {"status": "ok", "mode": "monolithic", "prefill_replicas": 0, "decode_replicas": 1}
    assert [m.id for m in client.models.list().data] == [MODEL]
    s = stats(ready)
    assert s["prefill"] == [] and len(s["decode"]) == 1
    d = s["decode"][0]
    assert "warmup_page" not in d and d["agent"] == d["worker_id"]  # no NIXL agent: named by its replica
    # The replica's interpreter switches threads at the configured interval (Python's default is 5 ms).
    assert d["gil_switch_interval_ms"] == pytest.approx(ARGS.decode.gil_switch_interval_ms) != 5.0
    st = d["stats"]
    assert (st["known_prefills"], st["reserved_pages"], st["held_pages"], st["awaiting_kv"]) == (0, 0, 0, 0)
    assert st["free_pages"] == st["total_pages"] == POOL


def test_concurrent_greedy_equals_offline(client, reference):
    """Six clients at once (every other one streamed); token for token what `LLM(pd=False)` generates."""
    jobs = [(f"conc{i}", 6 + 2 * i, i % 2 == 1) for i in range(6)]

    def run(job):
        name, m, stream = job
        r = client.completions.create(model=MODEL, prompt=reference.prompts[name], max_tokens=m, temperature=0,
                                      stream=stream, logprobs=0, extra_body={"ignore_eos": True})
        if stream:
            chunks = [c for c in r if c.choices]
            return ("".join(c.choices[0].text for c in chunks),
                    [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens],
                    chunks[-1].choices[0].finish_reason)
        c = r.choices[0]
        assert r.usage.completion_tokens == m and r.usage.prompt_tokens == len(reference.prompts[name])
        return c.text, c.logprobs.tokens, c.finish_reason

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(run, jobs))
    for (name, m, _), (text, tokens, finish) in zip(jobs, got):
        ids = reference.out[name][:m]
        assert (text, finish) == (reference.expect(name, m, ignore_eos=True)[0], "length"), name
        assert tokens == [reference.tok.decode([t]) for t in ids], name


def test_streamed_equals_non_streamed(client, reference):
    ids = reference.prompts["stream"]
    text, count, _ = reference.expect("stream", 32, ignore_eos=True)
    kw = dict(model=MODEL, prompt=ids, max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole.choices[0].text == text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == count == 32
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason == "length"


def test_echo_and_logprobs_equal_the_offline_engine(ready, reference):
    """The prompt's logprobs from the engine's own chunked prefill (two 256-token chunks, other
    requests' steps between), streamed with the echoed prompt in the first chunk, and not."""
    ids = reference.prompts["conc5"]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 2,
            "ignore_eos": True}
    events = sse_events(httpx.post(ready.url + "/v1/completions", json=body | {"stream": True},
                                   timeout=120).raise_for_status())
    assert events[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None  # the prompt's come first
    text, lp = join_chunks(events)
    check_echo_logprobs(text, lp, reference.llm, reference.tok, ids, 5, 2)
    whole = httpx.post(ready.url + "/v1/completions", json=body, timeout=120).raise_for_status().json()
    assert (whole["choices"][0]["text"], whole["choices"][0]["logprobs"]) == (text, lp)


def test_too_long_prompt_is_refused(client, ready):
    limit = httpx.get(ready.url + "/v1/models").json()["data"][0]["max_model_len"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt_ids(limit, seed=3), max_tokens=1)
    assert e.value.status_code == 400
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt_ids(limit - 10, seed=3), max_tokens=20)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens"


def test_client_disconnect_mid_stream_frees_pages(ready):
    whole_pool(ready)
    body = {"model": MODEL, "prompt": prompt_ids(200, seed=9), "max_tokens": 1500, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", ready.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            # Hold the line iterator: a dropped one is closed by the garbage collector, and
            # httpx then closes the stream, which is the disconnect this test makes later.
            lines = (x for x in resp.iter_lines() if x.startswith("data:"))
            events = [next(lines) for _ in range(10)]
            assert json.loads(events[0][5:])["choices"][0]["text"] is not None
            busy = wait_until(lambda: (s := decode_stats(ready))["running"] == 1 and s, 10, "the request running")
            assert busy["free_pages"] < POOL
        # Leaving the `with` closes the connection mid-stream: the engine aborts the request.
    whole_pool(ready)


def test_pool_ends_where_it_started(ready, client):
    # After every test above (finishes, refusals, a disconnect) the pool is whole again.
    client.completions.create(model=MODEL, prompt="last", max_tokens=3)
    whole_pool(ready, timeout_s=10)
    s = decode_stats(ready)
    assert s["decode_tokens"] > 0 and s["queued"] == 0 and s["running"] == 0 and s["queued_prompt_pages"] == 0


def test_decode_metrics_are_exported(ready):
    def scraped():
        text = ready.metrics()
        names = ("ray_dsa_pd_generated_tokens_total", "ray_dsa_pd_decode_ttft_seconds_count",
                 "ray_dsa_pd_request_itl_seconds_count", 'ray_dsa_pd_pages_used{')
        return all(n in text for n in names) and text
    text = wait_until(scraped, 60, "dsa-pd series on Ray's metrics endpoint")
    assert 'role="decode"' in text and 'role="prefill"' not in text
    assert "ray_dsa_pd_kv_push_bytes_total{" not in text  # nothing is pushed
