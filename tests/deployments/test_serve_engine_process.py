"""`serve run` of ``configs/tiny_pd.yaml`` with ``engine_process: true`` on both roles: each replica's
worker (engine, page pool, NIXL agent) runs in a child process of its own
(`deployments.engine_process`), and pages still move prefill -> decode over NIXL between those children.

Through the official openai client: concurrent and streamed greedy completions equal the offline engine's,
`/stats` names each replica's engine process (not the replica's own), both pools end where they started,
and killing the decode replica's engine process fails its replica's health check (Serve replaces it).
"""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest

from deployments.app_config import AppConfig
from tests.deployments.app_fixtures import merged, yaml_args
from tests.deployments.offline_reference import prompt_ids
from tests.deployments.serve_process import served_greedy_texts, stats, wait_until
from tests.deployments.shared_servers import ServerSpec, served_and_offline_fixtures

pytestmark = pytest.mark.slow

RAW = merged(yaml_args("tiny_pd.yaml"), prefill={"engine_process": True}, decode={"engine_process": True})
ARGS = AppConfig.model_validate(RAW)
MODEL = ARGS.model_name
PROMPTS = [prompt_ids(n, seed=900 + n) for n in (150, 7, 64, 300)]
TOKENS = 10

SERVER = ServerSpec("serve-engine-process", args=RAW, config_name="tiny_pd_engine_process.yaml")
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
    wait_until(lambda: _whole(server), 30, "both pools back at their start counts")


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
