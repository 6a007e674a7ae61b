"""Two prefill and two decode replicas (the tiny config with more replicas, half a CPU each,
and MTP with one draft token: greedy MTP output equals greedy output), and the fault matrix
of issue 23 on them (docs/reliability.md records it).

Checked: every prefill/decode pair handshakes before serving; concurrent
requests spread over both replicas of each pool and still equal the offline
engine (without MTP), with drafts proposed and verified. Faults, each made with
a signal to the real process (`/stats` names every replica's pid), each ending
with every pair handshaked again, every pool whole and the server answering:

- a prefill replica killed while idle is replaced by Serve with a new NIXL epoch
  that the decode replicas handshake with (the dead agent forgotten, never used);
- a prefill replica killed mid-push: the request's one retry runs on the other
  prefill replica (a new attempt with new pages) and its text equals the same
  request served again;
- a prefill replica frozen (SIGSTOP) past ``transfer.deadline_s``: 503 with the
  expiry, and once it runs again it settles and decode gets the held pages back;
- a decode replica killed mid-stream: the stream ends with an error event (503
  ``unavailable``) and ``[DONE]``, not a hang;
- the ingress replica killed with streams in flight: each client's stream ends
  (no hang), Serve restarts the ingress, the orphaned decode streams run out and
  free their pages.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from deployments.app_config import AppConfig
from tests.deployments.app_fixtures import merged, yaml_args
from tests.deployments.serve_process import stats, wait_until
from tests.deployments.shared_servers import ServerSpec, served_and_offline_fixtures
from tests.deployments.offline_reference import prompt_ids

pytestmark = pytest.mark.slow

DEADLINE_S = 8.0
"""``transfer.deadline_s``: short enough to outlast in the freeze test, long for a 1900-token prefill here."""
PEER_TTL_S = 24.0
"""``transfer.peer_ttl_s``: longer than the freeze (the 503 within ``DEADLINE_S + 5``, then up to 10 s to see
decode hold the pages), so that the frozen replica is not forgotten first: forgetting it releases the held
pages (16 s once left too little on a loaded CI machine)."""
RAW = merged(yaml_args("tiny_pd.yaml"), prefill={"num_replicas": 2, "num_cpus": 0.5, "mtp_draft_tokens": 1},
             decode={"num_replicas": 2, "num_cpus": 0.5, "mtp_draft_tokens": 1},
             transfer={"deadline_s": DEADLINE_S, "peer_ttl_s": PEER_TTL_S})
ARGS = AppConfig.model_validate(RAW)
MODEL = ARGS.model_name
PROMPTS = [prompt_ids(30 + 41 * i, seed=500 + i) for i in range(8)]
TOKENS = 10


def fully_meshed(server, exclude: set[str] = frozenset()):
    s = _stats_or_none(server)
    if s is None:
        return False
    pre, dec = s["prefill"], s["decode"]
    ok = (len(pre) == len(dec) == 2 and not exclude & {e["agent"] for e in pre + dec}
          and all(e["stats"]["known_decodes"] == 2 for e in pre)
          and all(e["stats"]["known_prefills"] == 2 for e in dec))
    return ok and s


def _stats_or_none(server):
    """``/stats``, or None while the ingress that answers it is down or restarting."""
    try:
        return stats(server)
    except (httpx.HTTPError, ValueError):
        return None


def pools_whole(server):
    s = _stats_or_none(server)
    return s is not None and (all(e["stats"]["free_pages"] == ARGS.prefill.num_pages for e in s["prefill"])
            and all(e["stats"]["free_pages"] == ARGS.decode.num_pages - 1 for e in s["decode"]) and s)


SERVER = ServerSpec("serve-multi", args=RAW, config_name="tiny_pd_2x2.yaml")
server, reference = served_and_offline_fixtures(SERVER, ARGS, PROMPTS, TOKENS)


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
    done0 = {e["worker_id"]: e["stats"]["completed"] for e in before["prefill"]}

    def settled():
        """Pools whole and every prefill counted: a replica's counters reach /stats at its next heartbeat,
        which can come after its pool is whole (a CI run under load read 1 of 8 prefills)."""
        s = pools_whole(ready)
        if not s:
            return None
        done = {e["worker_id"]: e["stats"]["completed"] for e in s["prefill"]}
        return s if sum(done[w] - done0.get(w, 0) for w in done) >= len(PROMPTS) else None

    after = wait_until(settled, 20, "pools back to their start counts and every prefill counted")
    done = {e["worker_id"]: e["stats"]["completed"] for e in after["prefill"]}
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
    t0 = time.monotonic()
    wait_until(lambda: fully_meshed(ready, exclude={victim["agent"]}), 180,
               "a replacement prefill replica handshaked with every decode replica")
    ready.wait_ready(timeout=60)
    meshed = time.monotonic() - t0
    assert run_all(client) == reference
    wait_until(lambda: pools_whole(ready), 20, "pools back to their start counts")
    print(f"MATRIX idle prefill killed: replacement handshaked by every decode replica {meshed:.1f}s after the "
          f"kill (the dead agent forgotten after transfer.peer_ttl_s {PEER_TTL_S:.0f}s); 8 requests equal the "
          f"offline engine")


# --------------------------------------------------------------------------- the fault matrix
LONG = 1900
"""Prompt tokens of the requests faults hit in prefill: 8 chunks of 256, 1.5-3 s of prefill here."""


def at_work(server, role: str, key: str):
    """The first ``role`` replica whose snapshot shows work (``stats[key] > 0``), else None."""
    s = _stats_or_none(server)
    return next((e for e in (s or {}).get(role, []) if e["stats"][key] > 0), None)


def recovered(server, exclude: set[str] = frozenset()) -> None:
    """Every pair handshaked again (without the agents in ``exclude``), every pool whole, a request answered."""
    wait_until(lambda: fully_meshed(server, exclude), 240, f"every pair handshaked again without {exclude}")
    server.wait_ready(timeout=60)
    wait_until(lambda: pools_whole(server), 60, "pools back to their start counts")
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    wait_until(lambda: pools_whole(server), 30, "pools back after the last request")


def hit_in_prefill(server, body: dict, tries: int = 3):
    """Send ``body`` (a long prompt) and return (the future of its answer, the prefill replica computing it)
    once a prefill replica reports work; a prefill that ends before it is seen is sent again (a new prompt)."""
    pool = ThreadPoolExecutor(1)
    for attempt in range(tries):
        body = {**body, "prompt": prompt_ids(LONG, seed=body["prompt"][0] + 1000 * attempt)}
        fut = pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=120)
        found = wait_until(lambda: at_work(server, "prefill", "active") or fut.done(), 30,
                           "a prefill replica at work", poll_s=0.05)
        if found is not True:
            return fut, found, body
        fut.result()
    raise AssertionError(f"no prefill replica was seen at work in {tries} tries")


def test_a_prefill_replica_killed_mid_push_costs_the_request_one_retry(ready):
    body = {"model": MODEL, "prompt": [11], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    fut, victim, body = hit_in_prefill(ready, body)
    os.kill(victim["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    r = fut.result()
    answered = time.monotonic() - t0
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    ready.wait_for_log(f"request {rid} lost its prefill replica; retrying once", 10)
    recovered(ready, exclude={victim["agent"]})
    print(f"MATRIX prefill killed mid-push: 200 after one retry, {answered:.1f}s after the kill; "
          f"replaced, re-handshaked, pools whole {time.monotonic() - t0:.1f}s after it")
    # The retry's answer is the request's: served again (no fault), the same text.
    again = httpx.post(ready.url + "/v1/completions", json=body, timeout=120)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
    wait_until(lambda: retries(ready) >= 1, 30, "dsa_pd_retries_total{reason=prefill_died} counted")


def retries(server) -> float:
    """``ray_dsa_pd_retries_total{reason="prefill_died"}`` summed over the decode replicas."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in server.metrics().splitlines()
               if line.startswith("ray_dsa_pd_retries_total{") and 'reason="prefill_died"' in line)


def test_a_prefill_replica_frozen_past_the_transfer_deadline_is_a_503_and_settles(ready):
    body = {"model": MODEL, "prompt": [12], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    for attempt in range(3):
        fut, victim, body = hit_in_prefill(ready, {**body, "prompt": [12 + 10 * attempt]})  # a new prompt each
        os.kill(victim["pid"], signal.SIGSTOP)
        t0 = time.monotonic()
        r = fut.result(timeout=DEADLINE_S + 20)
        if r.status_code != 200:
            break
        # The replica's stats lag its work by up to a heartbeat: this prefill had pushed its pages before the
        # freeze. Thaw it and freeze the next one (a new prompt).
        os.kill(victim["pid"], signal.SIGCONT)
    try:
        waited = time.monotonic() - t0
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "unavailable" and "KV transfer expired" in err["message"], err
        assert waited < DEADLINE_S + 5, waited
        # The frozen writer may still land a WRITE: decode holds the request's pages meanwhile (until prefill
        # settles, or is forgotten after PEER_TTL_S without a heartbeat).
        held = wait_until(lambda: (at_work(ready, "decode", "held_pages") or {}).get("stats"), 10,
                          "decode holding the expired request's pages")["held_pages"]
    finally:
        os.kill(victim["pid"], signal.SIGCONT)
    t1 = time.monotonic()
    # Running again, prefill reads decode's cancel, settles, and decode frees the pages; nobody is replaced.
    wait_until(lambda: pools_whole(ready), 30, "the held pages back once the frozen prefill settled")
    settled = time.monotonic() - t1
    recovered(ready)
    print(f"MATRIX prefill frozen past the {DEADLINE_S:.0f}s deadline: 503 {waited:.1f}s after the freeze; "
          f"{held} decode pages held meanwhile, back {settled:.1f}s after SIGCONT")
    assert victim["agent"] in {e["agent"] for e in stats(ready)["prefill"]}


def _stream_lines(url: str, body: dict, lines: list[str], started: threading.Event, ended: list) -> None:
    """Stream ``body``, appending every ``data:`` line; ``started`` once the first arrived; ``ended`` gets the
    way it ended (``"done"`` after ``[DONE]``, ``"closed"`` if the body ended without it, or the exception)."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
            if resp.status_code != 200:
                ended.append(f"HTTP {resp.status_code}")
                return
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    lines.append(line)
                    started.set()
        ended.append("done" if lines and lines[-1] == "data: [DONE]" else "closed")
    except Exception as e:  # noqa: BLE001 - how it ended is the finding
        ended.append(e)
    finally:
        started.set()


def test_a_decode_replica_killed_mid_stream_ends_the_stream_with_an_error_event(ready):
    body = {"model": MODEL, "prompt": prompt_ids(40, seed=960), "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    lines, started, ended = [], threading.Event(), []
    t = threading.Thread(target=_stream_lines, args=(ready.url, body, lines, started, ended))
    t.start()
    assert started.wait(60) and lines, ended
    victim = wait_until(lambda: at_work(ready, "decode", "running"), 10, "the decode replica streaming it")
    os.kill(victim["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    t.join(60)
    assert not t.is_alive(), "the stream hangs after its decode replica died"
    assert ended == ["done"], ended
    ended_s = time.monotonic() - t0
    assert ended_s < 30
    err = json.loads(lines[-2].removeprefix("data:"))["error"]
    assert err["code"] == "unavailable" and "decode replica" in err["message"], err
    recovered(ready, exclude={victim["agent"]})
    print(f"MATRIX decode killed mid-stream ({len(lines) - 2} chunks in): error event + [DONE] {ended_s:.1f}s "
          f"after the kill; replaced, re-handshaked, pools whole {time.monotonic() - t0:.1f}s after it")


def test_the_ingress_killed_with_streams_in_flight(ready, client, reference):
    pid = stats(ready)["ingress"]["pid"]
    streams = []
    for i in range(3):
        body = {"model": MODEL, "prompt": prompt_ids(30, seed=970 + i), "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        lines, started, ended = [], threading.Event(), []
        t = threading.Thread(target=_stream_lines, args=(ready.url, body, lines, started, ended))
        t.start()
        streams.append((t, started, ended))
    for _, started, ended in streams:
        assert started.wait(60), ended
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    for t, _, ended in streams:
        t.join(60)
        assert not t.is_alive(), "a client's stream hangs after the ingress died"
        assert ended and ended[0] != "done", ended  # cut off, one way or another
    cut = time.monotonic() - t0
    # Serve restarts the ingress; the orphaned decode streams run to their end and free their pages.
    ready.wait_ready(timeout=180)
    back = time.monotonic() - t0
    assert stats(ready)["ingress"]["pid"] != pid
    recovered(ready)
    assert run_all(client) == reference
    print(f"MATRIX ingress killed with 3 streams in flight: every stream cut within {cut:.1f}s "
          f"({[repr(e[0])[:60] for _, _, e in streams]}); answering again {back:.1f}s after the kill; "
          f"pools whole {time.monotonic() - t0:.1f}s after it")
