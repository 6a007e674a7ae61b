"""Two prefill and two decode replicas (the tiny config with more replicas, half a CPU each,
and MTP with one draft token: greedy MTP output equals greedy output).

Checked: every prefill/decode pair handshakes before serving; concurrent
requests spread over both replicas of each pool and still equal the offline
engine (without MTP), with drafts proposed and verified; a prefill replica killed mid-service is replaced by Serve with a new
NIXL epoch that the decode replicas handshake with (and the dead one is
forgotten), after which requests succeed and every pool is whole again.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from deployments.app_config import AppConfig
from tests.deployments.app_fixtures import merged, yaml_args
from tests.deployments.serve_process import served_and_offline_fixtures, stats, wait_until
from tests.deployments.offline_reference import prompt_ids

pytestmark = pytest.mark.slow

RAW = merged(yaml_args("tiny_pd.yaml"), prefill={"num_replicas": 2, "num_cpus": 0.5, "mtp_draft_tokens": 1},
             decode={"num_replicas": 2, "num_cpus": 0.5, "mtp_draft_tokens": 1})
ARGS = AppConfig.model_validate(RAW)
MODEL = ARGS.model_name
PROMPTS = [prompt_ids(30 + 41 * i, seed=500 + i) for i in range(8)]
TOKENS = 10


def fully_meshed(server, exclude: set[str] = frozenset()):
    s = stats(server)
    pre, dec = s["prefill"], s["decode"]
    ok = (len(pre) == len(dec) == 2 and not exclude & {e["agent"] for e in pre}
          and all(e["stats"]["known_decodes"] == 2 for e in pre)
          and all(e["stats"]["known_prefills"] == 2 for e in dec))
    return ok and s


def pools_whole(server):
    s = stats(server)
    return (all(e["stats"]["free_pages"] == ARGS.prefill.num_pages for e in s["prefill"])
            and all(e["stats"]["free_pages"] == ARGS.decode.num_pages - 1 for e in s["decode"]) and s)


server, reference = served_and_offline_fixtures("serve-multi", "tiny_pd_2x2.yaml", RAW, ARGS, PROMPTS, TOKENS)


@pytest.fixture(scope="module")
def ready(server, reference):
    server.wait_ready(timeout=300)
    wait_until(lambda: fully_meshed(server), 60, "every prefill/decode pair handshaked")
    return server


@pytest.fixture(scope="module")
def client(ready):
    return openai.OpenAI(base_url=ready.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def run_all(client) -> list[str]:
    def one(i):
        return client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, range(len(PROMPTS))))


def test_requests_spread_over_both_replicas_of_each_pool(ready, client, reference):
    before = stats(ready)
    assert run_all(client) == reference
    after = wait_until(lambda: pools_whole(ready), 20, "pools back to their start counts")
    done = {e["worker_id"]: e["stats"]["completed"] for e in after["prefill"]}
    done0 = {e["worker_id"]: e["stats"]["completed"] for e in before["prefill"]}
    per_prefill = [done[w] - done0.get(w, 0) for w in done]
    tokens = {e["worker_id"]: e["stats"]["decode_tokens"] for e in after["decode"]}
    tokens0 = {e["worker_id"]: e["stats"]["decode_tokens"] for e in before["decode"]}
    per_decode = [tokens[w] - tokens0.get(w, 0) for w in tokens]
    assert sum(per_prefill) == len(PROMPTS) and min(per_prefill) > 0, per_prefill
    assert min(per_decode) > 0, per_decode
    assert sum(e["stats"]["mtp_drafted"] for e in after["decode"]) > 0


def test_a_killed_prefill_replica_is_replaced_and_rehandshaked(ready, client, reference):
    victim = stats(ready)["prefill"][0]
    os.kill(victim["pid"], signal.SIGKILL)
    # Serve starts a replacement (a new agent epoch); the dead agent leaves the
    # directory and every decode replica forgets it and handshakes with the new one.
    wait_until(lambda: fully_meshed(ready, exclude={victim["agent"]}), 180,
               "a replacement prefill replica handshaked with every decode replica")
    ready.wait_ready(timeout=60)
    assert run_all(client) == reference
    wait_until(lambda: pools_whole(ready), 20, "pools back to their start counts")
