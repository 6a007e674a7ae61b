"""`serve run` of ``configs/tiny_pd.yaml`` with ``engine_process: true`` on both roles, two ingress
replicas (``ingress.num_replicas``) and HAProxy in front of them (``RAY_SERVE_ENABLE_HA_PROXY=1``,
deployments/http_frontend.py: the shape a GPU deployment runs): each replica's
worker (engine, page pool, NIXL agent) runs in a child process of its own
(`deployments.engine_process`), and pages still move prefill -> decode over NIXL between those children.

Through the official openai client: concurrent and streamed greedy completions equal the offline engine's,
`/stats` names each replica's engine process (not the replica's own) and is answered by both ingress replicas
(each behind HAProxy), both pools end where they started, a client that hangs up mid-stream has its request
aborted through HAProxy (the pages come back long before its tokens would have ended),
each replica's step trace (``DSA_PD_STEP_TRACE``) holds its steps, and killing the decode replica's engine process fails its replica's health check (Serve replaces it).
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import openai
import pytest

from deployments.app_config import AppConfig
from deployments.metrics import hop_trace
from deployments.metrics.step_trace import periods, read, summarize
from tests.deployments.app_fixtures import merged, yaml_args
from tests.deployments.offline_reference import prompt_ids
from tests.deployments.serve_process import haproxy_env, served_greedy_texts, stats, wait_until
from tests.deployments.shared_servers import ServerSpec, served_and_offline_fixtures

pytestmark = pytest.mark.slow

RAW = merged(yaml_args("tiny_pd.yaml"), prefill={"engine_process": True}, decode={"engine_process": True},
             ingress={"num_replicas": 2})
ARGS = AppConfig.model_validate(RAW)
MODEL = ARGS.model_name
PROMPTS = [prompt_ids(n, seed=900 + n) for n in (150, 7, 64, 300)]
TOKENS = 10

TRACE = Path(tempfile.mkdtemp(prefix="dsapd-steptrace-"))
HOPS = Path(tempfile.mkdtemp(prefix="dsapd-hops-"))
SERVER = ServerSpec("serve-engine-process", args=RAW, config_name="tiny_pd_engine_process.yaml",
                    env={"DSA_PD_STEP_TRACE": str(TRACE), "DSA_PD_HOP_TRACE": str(HOPS), **haproxy_env()})
server, reference = served_and_offline_fixtures(SERVER, ARGS, PROMPTS, TOKENS)


def _whole(server) -> bool:
    s = stats(server)
    return all(e["stats"]["free_pages"] == ARGS.prefill.num_pages for e in s["prefill"]) and \
        all(e["stats"]["free_pages"] == ARGS.decode.num_pages - 1 for e in s["decode"])  # - the warm-up page


def test_engine_processes_answer_like_the_offline_engine(server, reference):
    server.wait_ready(timeout=300)
    s = stats(server)
    for entry in s["prefill"] + s["decode"]:
        assert entry["engine_pid"] not in (None, entry["pid"]), entry
        assert os.path.exists(f"/proc/{entry['engine_pid']}")
    # Each engine process logs into its replica's Serve log file too (where a replica's errors are looked for).
    logs = "".join(p.read_text(errors="replace")
                   for p in (server.ray_tmp / "ray" / "session_latest" / "logs" / "serve").glob("replica_*.log"))
    for entry in s["prefill"] + s["decode"]:
        assert f"engine process {entry['engine_pid']} (replica {entry['pid']})" in logs, logs[-3000:]
    texts, streamed = served_greedy_texts(server, MODEL, PROMPTS, TOKENS, streamed=3)
    assert texts == reference and streamed == reference[3]
    # ingress.num_replicas 2: HAProxy spreads requests over both (each answers /stats with its own pid), each
    # on its own HTTP server (Serve's direct ingress), with no Python proxy in between.
    answers = [stats(server)["ingress"] for _ in range(40)]
    assert len({a["pid"] for a in answers}) == 2, answers
    assert {a["http_frontend"] for a in answers} == {"haproxy"}
    assert "HAProxy started successfully" in server.log()
    wait_until(lambda: _whole(server), 30, "both pools back at their start counts")


def test_a_client_hanging_up_mid_stream_aborts_its_request(server, reference):
    """HAProxy closes its connection to the ingress replica when the client's goes: the ingress sees the
    disconnect and aborts the request (decode stops, prefill's and decode's pages come back)."""
    import httpx

    server.wait_ready(timeout=300)
    wait_until(lambda: _whole(server), 30, "both pools at their start counts")
    tokens_before = stats(server)["decode"][0]["stats"]["decode_tokens"]
    want = 2048 - len(PROMPTS[0]) - 1  # the tiny model's whole context
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": want, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                break  # hang up: leaving the block closes the connection
    wait_until(lambda: _whole(server), 60, "both pools back at their start counts after the hang-up")
    time.sleep(1.5)  # the replica's last counters reach the directory at its next heartbeats
    decoded = stats(server)["decode"][0]["stats"]["decode_tokens"] - tokens_before
    assert decoded < want // 2, f"{decoded} of {want} tokens decoded: the hang-up did not abort the request"


def test_the_step_trace_has_every_replicas_steps(server, reference):
    """DSA_PD_STEP_TRACE: each replica appends the steps its engine process ran (crossing the process boundary
    with their end times) to its own JSONL file; a fresh prompt's prefill and decode steps show up there,
    and the summary's wall time covers the steps inside it."""
    server.wait_ready(timeout=300)
    s = stats(server)
    files = {role: TRACE / f"{role}-{s[role][0]['pid']}.jsonl" for role in ("prefill", "decode")}
    before = {role: len(read(f)) if f.exists() else 0 for role, f in files.items()}
    t0 = time.time()
    prompt = prompt_ids(200, seed=31)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=180)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == TOKENS
    # The replicas hand their steps on at their heartbeats (twice a second): the decode steps may arrive
    # over several, so wait for all of the request's tokens, not the first new line.
    want = {"prefill": len(prompt), "decode": TOKENS - 1}
    wait_until(lambda: all(f.exists() and sum(x["tokens"] for x in read(f, skip=before[r])) >= want[r]
                           for r, f in files.items()), 15, "both replicas' steps of the request in the trace")
    pre = read(files["prefill"], skip=before["prefill"])
    assert {r["kind"] for r in pre} == {"prefill"} and sum(r["tokens"] for r in pre) == len(prompt)
    dec = read(files["decode"], skip=before["decode"])
    assert {r["kind"] for r in dec} == {"decode"} and sum(r["tokens"] for r in dec) == TOKENS - 1  # token 1: prefill's
    for r in pre + dec:
        assert t0 < r["ended"] - r["seconds"] < r["ended"] < time.time() and r["role"] in files
    # DSA_PD_HOP_TRACE: the request's points, written by the ingress, the decode replica and its engine
    # process, in the order of its path.
    (hops,) = [h for h in hop_trace.read(HOPS).values() if min(h.values()) > t0]
    order = ["ingress.parsed", "ingress.dispatched", "decode.entered", "prefill.entered", "prefill.emitted",
             "prefill.received", "prefill.returned", "engine.emitted", "decode.received", "decode.yielded",
             "ingress.first_output"]
    assert sorted(hops, key=hops.get) == order, hops
    (p,) = periods(dec, gap_s=5.0)
    summary = summarize(p)
    assert summary["kinds"]["decode"]["steps"] == len(dec)
    assert summary["wall_s"] >= summary["inside_steps_s"] - 1e-6
    assert abs(summary["wall_s"] - summary["inside_steps_s"] - summary["between_steps_s"]) < 1e-3


def test_a_dead_engine_process_gets_its_replica_replaced(server, reference):
    server.wait_ready(timeout=300)
    (victim,) = stats(server)["decode"]
    os.kill(victim["engine_pid"], signal.SIGKILL)
    # Serve's health check (`check_health` -> `EngineProcess.check`) fails; a new replica with a new engine
    # process takes its place and answers.
    wait_until(lambda: [e["engine_pid"] for e in stats(server)["decode"]] not in ([], [victim["engine_pid"]]),
               240, "a new decode replica with its own engine process")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=2, timeout=180)
    end = time.monotonic() + 120
    while True:  # the new replica handshakes with prefill before it serves PD requests
        try:
            text = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
            break
        except openai.APIStatusError:
            if time.monotonic() > end:
                raise
            time.sleep(2)
    assert text == reference[1]
