"""`serve run` with tensor_parallel_size 2 on both roles (CPU, gloo): each
Serve replica reserves a placement group of 2 bundles and drives 2 rank
worker actors; prefill rank i pushes to decode rank i over NIXL.

Checked through the official openai client, with two-batch overlap on:
greedy completions (streamed and not, concurrent, prompts that span pages and
chunks) equal the offline single-process engine (`LLM(pd=False)`, whole
forwards), and both pools return to their start counts.
"""

from __future__ import annotations

import re
import time

import pytest

from deployments.app_config import AppConfig
from tests.deployments.app_fixtures import merged, yaml_args
from tests.deployments.serve_process import served_greedy_texts, stats
from tests.deployments.shared_servers import ServerSpec, served_and_offline_fixtures
from tests.deployments.offline_reference import prompt_ids

pytestmark = pytest.mark.slow

# Half a CPU per rank: 2 ranks x 2 roles fit the 2-core CI machine (the ingress and directory take none).
# Two-batch overlap on (models/two_batch.py): every rank runs its multi-request forwards as two
# micro-batches on process groups of their own; the answers stay the offline engine's.
RAW = merged(yaml_args("tiny_pd.yaml"),
             prefill={"tensor_parallel_size": 2, "num_cpus": 0.5, "chunk_size": 64},
             decode={"tensor_parallel_size": 2, "num_cpus": 0.5},
             features={"two_batch_overlap": True})
ARGS = AppConfig.model_validate(RAW)
MODEL = ARGS.model_name
PROMPTS = [prompt_ids(n, seed=700 + n) for n in (150, 7, 64, 90)]
TOKENS = 10


SERVER = ServerSpec("serve-tp", args=RAW, config_name="tiny_pd_tp2.yaml")
server, reference = served_and_offline_fixtures(SERVER, ARGS, PROMPTS, TOKENS)


def test_tp2_pools_answer_like_the_offline_engine(server, reference):
    server.wait_ready(timeout=420)
    # Two replicas (prefill, decode), each with two rank workers in their own processes.
    started = re.findall(r"(prefill|decode)-\S+: 2 rank workers started \(pids \[(\d+), (\d+)\], "
                         r"bundles \[0, 1\] of the replica's placement group\)", server.log())
    assert sorted(r for r, *_ in started) == ["decode", "prefill"], server.tail(80)
    assert len({p for _, *pids in started for p in pids}) == 4
    assert len(re.findall(r"(prefill|decode)-\S+: two-batch overlap on", server.log())) == 2, server.tail(80)

    texts, streamed = served_greedy_texts(server, MODEL, PROMPTS, TOKENS)
    assert texts == reference and streamed == reference[0]

    end = time.monotonic() + 30
    while True:
        s = stats(server)
        whole = (all(e["stats"]["free_pages"] == ARGS.prefill.num_pages for e in s["prefill"])
                 and all(e["stats"]["free_pages"] == ARGS.decode.num_pages - 1 for e in s["decode"]))  # - warm-up page
        if whole or time.monotonic() > end:
            break
        time.sleep(0.5)
    assert whole, s
