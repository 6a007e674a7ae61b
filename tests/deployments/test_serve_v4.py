"""`serve run configs/tiny_v4_pd.yaml` end to end with the official `openai` client: DeepSeek-V4,
one prefill and one decode replica, every cache group's pages pushed over NIXL (DRAM).

One server start. The reference is the offline engine (`LLM(pd=False)`) on the tiny model of the
same spec. Checked: `/health`; concurrent greedy completions (streamed and not, prompts
crossing the window, several compressed blocks, a 256-token page and 1,024 tokens) equal the reference token for
token; a chat completion answers through the tiny model's template; both pools end where they
started.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import yaml

from deployments.app_config import AppConfig
from tests.deployments.app_fixtures import CONFIGS
from tests.deployments.offline_reference import Reference, prompt_ids, reference_llm
from tests.deployments.serve_process import stats, wait_until
from tests.deployments.shared_servers import ServerSpec, server_fixture

pytestmark = pytest.mark.slow

CONFIG = CONFIGS / "tiny_v4_pd.yaml"
ARGS = AppConfig.model_validate(yaml.safe_load(CONFIG.read_text())["applications"][0]["args"])
MODEL = ARGS.model_name
# 1,300 tokens: over the 1,024 that the DSA rule's 64-token pages would allow the prefill role's 16
# pages (the ingress counts V4's cache groups: deployments.admission.PoolFit).
PROMPTS = {f"p{i}": prompt_ids(n, seed=400 + i) for i, n in enumerate((1, 9, 37, 260, 1300))}


SERVER = ServerSpec("serve-v4", config=CONFIG)
server = server_fixture(SERVER)


@pytest.fixture(scope="module")
def reference(server):
    """Computed while the server starts."""
    with reference_llm(ARGS, num_pages=ARGS.decode.num_pages, pd=False) as (llm, tok, _):
        yield Reference(llm, tok, PROMPTS)


@pytest.fixture(scope="module")
def client(server, reference):
    server.wait_ready(timeout=240)
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _pools_whole(server) -> bool:
    s = stats(server)
    (p,), (d,) = s["prefill"], s["decode"]
    d = d["stats"]
    return p["stats"]["free_pages"] == p["stats"]["total_pages"] and d["requests"] == 0 \
        and d["free_pages"] == d["total_pages"] - d["reserved_pages"]


def test_served_v4_equals_offline(server, client, reference):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    jobs = [(name, 6 + i, i % 2 == 1) for i, name in enumerate(PROMPTS)]

    def run(job):
        name, m, stream = job
        r = client.completions.create(model=MODEL, prompt=PROMPTS[name], max_tokens=m, temperature=0, stream=stream,
                                      logprobs=0, extra_body={"ignore_eos": True})
        if stream:
            chunks = [c for c in r if c.choices]
            return "".join(c.choices[0].text for c in chunks), \
                [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        return r.choices[0].text, r.choices[0].logprobs.tokens

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(run, jobs))
    for (name, m, _), (text, tokens) in zip(jobs, got):
        assert text == reference.expect(name, m, ignore_eos=True)[0], name
        assert tokens == [reference.tok.decode([t]) for t in reference.out[name][:m]], name

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi V4"}], max_tokens=5,
                                          temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens >= 1
    wait_until(lambda: _pools_whole(server), 20, "both pools back at their start counts")
