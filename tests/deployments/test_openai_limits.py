"""Hostile request bodies and admission, without a server: the JSON decoder and body reader
(deployments/openai/limits.py), property-based fuzzing of both endpoints' request parsing with
hypothesis, and the ingress's admission rules (deployments/admission.py: the page-pool fit, the
in-flight bound, the overload messages the replicas count).

The same body strategies run against a served app, bounded, in
tests/deployments/test_serve_reliability.py; here they run many more examples, since each costs
microseconds.
"""

from __future__ import annotations

import gc
import json

import pytest
from hypothesis import HealthCheck, given, settings
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from attention.formats import pages_for_tokens
from deployments.admission import (
    InFlight,
    PoolFit,
    ingress_replicas,
    max_requests,
    overload_message,
    overload_reason,
    queue_timeout_s,
    waited,
)
from deployments.app_config import AppConfig
from deployments.metrics.replica import _prefill_refusal
from deployments.metrics.table import REJECTION_REASONS
from deployments.openai.errors import ContextLengthExceeded, InvalidRequest, OpenAIError, Overloaded, check_prompt_length
from deployments.openai.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_JSON_DEPTH,
    BodyTooLarge,
    decode_json,
    read_body,
)
from deployments.openai.protocol import parse_request
from tests.deployments.app_fixtures import merged, shipped_model, yaml_args
from tests.deployments.hostile_bodies import raw_bodies
from workers.page_pool import PagePool
from workers.request import Request as EngineRequest
from workers.sample.params import SamplingParams
from workers.scheduler import Scheduler, SchedulerConfig

VOCAB = 320  # the tiny models'


# --------------------------------------------------------------------------- the JSON decoder


@pytest.mark.parametrize("body, needle", [
    (b"\xff\xfe{\x00}\x00", "not valid UTF-8"),  # UTF-16: json.loads(bytes) would guess the codec
    (b'{"prompt": "caf\xe9"}', "not valid UTF-8"),  # Latin-1
    (b"[" * 100_000 + b"]" * 100_000, "deeper than 64"),  # past the C scanner's recursion limit
    (b'{"a":' * 65 + b"1" + b"}" * 65, "deeper than 64"),  # under it, past ours
    (b'{"t": NaN}', "NaN is not a JSON value"),
    (b'{"t": -Infinity}', "-Infinity is not a JSON value"),
    (b'{"t": 1e400}', "does not fit a 64-bit float"),
    (b'{"t": ' + b"9" * 5000 + b"}", "more than 4300 digits"),
    (b'{"prompt": "\\ud800"}', "not valid Unicode"),  # a lone surrogate: the tokenizer raises TypeError
    (b'{"\\udfff": 1}', "not valid Unicode"),
    (b'{"prompt": [1, 2, "\\ud800", 3]}', "not valid Unicode"),  # among scalars: a list's items are looked into
    (b'[1, 2.5, true, null, ' + b"[" * 64 + b"]" * 64 + b"]", "deeper than 64"),
    (b"\xef\xbb\xbf{}", "not valid JSON"),  # a BOM
    (b"", "not valid JSON"),
])
def test_decode_json_refuses_what_is_not_strict_utf8_json(body, needle):
    with pytest.raises(InvalidRequest) as e:
        decode_json(body)
    assert e.value.status_code == 400 and needle in e.value.message


def test_decode_json_takes_ordinary_bodies():
    assert decode_json(b'{"a": [1, 2.5, {"b": "\\u00e9\\ud83d\\ude42"}], "c": null}') == {
        "a": [1, 2.5, {"b": "é🙂"}], "c": None}
    nested = b"[" * DEFAULT_MAX_JSON_DEPTH + b"]" * DEFAULT_MAX_JSON_DEPTH
    assert decode_json(nested) is not None  # exactly the limit
    with pytest.raises(InvalidRequest, match="deeper than 3"):
        decode_json(b"[[[[]]]]", max_depth=3)
    with pytest.raises(InvalidRequest, match=r"^args\.x is not valid JSON"):
        decode_json("{", what="args.x")


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=raw_bodies("m", VOCAB, chat=False) | raw_bodies("m", VOCAB, chat=True))
def test_fuzzed_bodies_are_parsed_or_refused_with_a_4xx(chat, data):
    # Whatever the bytes, parsing, the context and page-pool checks and the sampling parameters
    # either give a request or raise an OpenAI error the ingress answers with a 4xx: never anything
    # else (which the ingress would answer 500).
    fit = PoolFit(decode_pages=7, prefill_pages=16, draft_tokens=0, monolithic=False)
    try:
        req = parse_request(data, "chat" if chat else "completion")
        prompt = len(req.prompt) if not chat and isinstance(req.prompt, list) else 10
        max_new = check_prompt_length(prompt, req.completion_limit, 512, "prompt")
        max_new = fit.fit(prompt, max_new, req.completion_limit is not None, "prompt")
        try:
            params = req.sampling_params(max_new)
        except ValueError:  # the ingress answers these 400 (OpenAIIngress._params)
            return
    except OpenAIError as e:
        assert 400 <= e.status_code < 500, e
        assert e.to_response().error.message
        return
    assert 1 <= params.max_new_tokens <= max_new


# --------------------------------------------------------------------------- the body reader


def _echo_app(limit: int) -> TestClient:
    async def endpoint(request: Request):
        try:
            return JSONResponse({"n": len(await read_body(request, limit))})
        except OpenAIError as e:
            return JSONResponse(e.to_response().model_dump(), status_code=e.status_code)

    return TestClient(Starlette(routes=[Route("/", endpoint, methods=["POST"])]))


def test_read_body_stops_at_the_limit():
    client = _echo_app(1000)
    assert client.post("/", content=b"x" * 1000).json() == {"n": 1000}
    r = client.post("/", content=b"x" * 1001)  # Content-Length says so: refused before reading
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: chunked, counted as it arrives
        for _ in range(10):
            yield b"y" * 300

    r = client.post("/", content=chunks())
    assert r.status_code == 413 and "longer than 1000 bytes" in r.json()["error"]["message"]
    assert BodyTooLarge("x").status_code == 413 and DEFAULT_MAX_BODY_BYTES == AppConfig.model_validate(
        yaml_args("tiny_pd.yaml")).limits.max_body_bytes


# --------------------------------------------------------------------------- admission


@pytest.mark.parametrize("monolithic, draft", [(True, 0), (True, 2), (False, 0), (False, 1)])
def test_pool_fit_agrees_with_the_engine_and_the_page_counts(monolithic, draft):
    pages = 9
    fit = PoolFit(decode_pages=pages, prefill_pages=None if monolithic else 12, draft_tokens=draft,
                  monolithic=monolithic)
    for prompt in (1, 63, 64, 65, 300, 575):
        room = None
        for new in range(1, pages * 64 + 2):
            try:
                assert fit.fit(prompt, new, True, "prompt") == new
            except ContextLengthExceeded as e:
                assert e.status_code == 400 and e.param in ("max_tokens", "prompt") and "page pool" in e.message
                room = new - 1
                break
        if monolithic:
            # The engine's own admission refuses exactly what the ingress refuses.
            sched = Scheduler(PagePool(pages), SchedulerConfig(max_batch_size=4, chunk_size=64, mtp_draft_tokens=draft))
            for new, refused in ((room, False), (room + 1, True)):
                if new < 1:
                    continue
                req = EngineRequest("r", [1] * prompt, SamplingParams(max_new_tokens=new))
                sched.add(req)
                assert req.finished == refused, (prompt, new)
        else:
            # pd: the most a running request of prompt + new tokens holds fits the pool, one more does not.
            from workers.scheduler import tokens_to_hold

            assert room == 0 or pages_for_tokens(tokens_to_hold(prompt + room - 1, draft)) <= pages
            assert pages_for_tokens(tokens_to_hold(prompt + room, draft)) > pages
        # Not asked (max_tokens None: what the context leaves): cut to what the pool holds.
        if room >= 1:
            assert fit.fit(prompt, 10**6, False, "prompt") == room
        else:  # the prompt and one token do not fit: refused either way
            with pytest.raises(ContextLengthExceeded, match="cannot hold it"):
                fit.fit(prompt, 10**6, False, "prompt")


def test_pool_fit_refuses_a_prompt_no_pool_holds():
    fit = PoolFit(decode_pages=7, prefill_pages=4, draft_tokens=0, monolithic=False)
    with pytest.raises(ContextLengthExceeded, match="prefill replica's page pool has 4") as e:
        fit.fit(4 * 64 + 1, 1, True, "messages")
    assert e.value.param == "messages"
    fit = PoolFit(decode_pages=2, prefill_pages=None, draft_tokens=0, monolithic=True)
    with pytest.raises(ContextLengthExceeded, match="cannot hold it and one generated token") as e:
        fit.fit(128, 1, False, "prompt")
    assert e.value.param == "prompt"
    assert PoolFit.of(AppConfig.model_validate(yaml_args("tiny_pd.yaml"))) == PoolFit(511, 256, 0, False)
    assert PoolFit.of(AppConfig.model_validate(yaml_args("tiny_mono.yaml"))) == PoolFit(512, None, 0, True)


def test_in_flight_bound_and_its_slots():
    flight = InFlight(2)
    a, b = flight.enter(), flight.enter()
    with pytest.raises(Overloaded) as e:
        flight.enter()
    assert e.value.status_code == 429 and "limits.max_requests" in e.value.message
    a.release()
    a.release()  # idempotent
    assert flight.count == 1

    class Holder:
        pass

    holder = Holder()
    flight.enter(holder)  # released when its holder goes (a stream whose generator never ran)
    assert flight.count == 2
    del holder
    gc.collect()
    assert flight.count == 1
    b.release()
    assert flight.count == 0


def test_limits_defaults_follow_the_roles():
    pd = AppConfig.model_validate(yaml_args("tiny_pd.yaml"))
    assert max_requests(pd) == 2 * 1 * pd.decode.ongoing_requests_cap
    assert queue_timeout_s(pd) == pd.transfer.deadline_s / 2
    mono = AppConfig.model_validate(yaml_args("tiny_mono.yaml"))
    assert queue_timeout_s(mono) == 60
    auto = AppConfig.model_validate(merged(yaml_args("tiny_pd.yaml"), decode={
        "num_replicas": None, "autoscaling": {"min_replicas": 1, "max_replicas": 3}},
        limits={"queue_timeout_s": 5}))
    # 3 x 16 streams: two ingress replicas (one per 32), each holding half the default.
    assert ingress_replicas(auto) == 2 and queue_timeout_s(auto) == 5
    assert max_requests(auto) == 2 * 3 * auto.decode.ongoing_requests_cap // 2
    # Several ingress replicas share the default out (rounded up); an explicit limit is per replica.
    three = AppConfig.model_validate(merged(yaml_args("tiny_pd.yaml"), ingress={"num_replicas": 3}))
    assert max_requests(three) == -(-2 * three.decode.ongoing_requests_cap // 3)
    assert 3 * max_requests(three) - 2 * three.decode.ongoing_requests_cap in (0, 1, 2)
    set3 = AppConfig.model_validate(merged(yaml_args("tiny_pd.yaml"), ingress={"num_replicas": 3},
                                           limits={"max_requests": 7}))
    assert max_requests(set3) == 7
    with pytest.raises(ValueError, match="ingress.num_replicas"):
        AppConfig.model_validate(merged(yaml_args("tiny_pd.yaml"), ingress={"num_replicas": 0}))


def test_ingress_replicas_default_to_one_per_32_decode_streams():
    def reps(**decode) -> int:
        return ingress_replicas(AppConfig.model_validate(merged(yaml_args("tiny_pd.yaml"), decode=decode)))

    assert reps() == 1  # 16 streams
    assert reps(max_batch_size=128) == 4 and reps(max_batch_size=129) == 5
    assert reps(num_replicas=None, autoscaling={"min_replicas": 1, "max_replicas": 3}, max_batch_size=64) == 6
    assert reps(num_replicas=8, max_batch_size=128) == 8  # 32 by the rule; capped
    two = AppConfig.model_validate(merged(yaml_args("tiny_pd.yaml"), decode={"max_batch_size": 128},
                                          ingress={"num_replicas": 2}))
    assert ingress_replicas(two) == 2
    # The default admission limit is shared out over the default replica count too.
    four = AppConfig.model_validate(merged(yaml_args("tiny_pd.yaml"), decode={"max_batch_size": 128}))
    assert max_requests(four) == 2 * four.decode.ongoing_requests_cap // 4


def test_a_queue_timeout_past_the_transfer_deadline_is_a_violation():
    from deployments.controller import check_args

    args = merged(yaml_args("tiny_pd.yaml"), limits={"queue_timeout_s": 30})
    assert [v.path for v in check_args(args).violations] == ["limits.queue_timeout_s"]
    assert check_args(merged(yaml_args("tiny_pd.yaml"), limits={"queue_timeout_s": 29})).ok


def test_overload_messages_carry_role_and_reason():
    for role, reasons in REJECTION_REASONS.items():
        for reason in set(reasons) & {"pages", "queue_timeout"}:
            msg = overload_message(role, reason, "detail")
            assert msg.startswith("overloaded: ") and overload_reason(msg) == (role, reason)
    assert overload_reason("overloaded: decode page pool: request needs 9 pages") == ("decode", "pages")
    assert overload_reason("prefill page pool: full") is None and overload_reason(None) is None
    # A prefill refusal is counted by the prefill replica, by its reason.
    assert _prefill_refusal(overload_message("prefill", "queue_timeout", "x")) == "queue_timeout"
    assert _prefill_refusal("handshake: stale") == "handshake"
    assert waited(None, 3) is None and waited(100.0, 3, now=99.0) is None
    assert "within 3s" in waited(100.0, 3, now=101.0)


def test_overloaded_is_a_429_with_retry_after():
    e = Overloaded("busy", retry_after_s=2)
    assert (e.status_code, e.code, e.headers()) == (429, "overloaded", {"Retry-After": "2"})
    assert json.loads(e.to_json())["error"]["code"] == "overloaded"


def test_pool_fit_counts_deepseek_v4_cache_groups():
    """DeepSeek-V4: each cache group gets the role's num_pages pages of 256 tokens (the sliding-window
    keys and, with the prefix cache, the CSA state groups' page per 256-token cut bound a sequence), not
    the 64-token pages of the DSA rule."""
    from workers.v4_prefix import cut_tokens, pages_with_cuts

    args = AppConfig.model_validate(yaml_args("tiny_v4_pd.yaml"))
    fit = PoolFit.of(args, shipped_model("tiny_v4_pd.yaml"))
    assert {g.kind for g in fit.groups} >= {"swa", "compressed"}
    assert fit.cut_groups == ("csa_state", "csa_index_state")  # features.prefix_caching: on by default
    cap = fit.capacity(args.prefill.num_pages)
    assert cap > args.prefill.num_pages * 64  # what the DSA rule would have allowed

    def pages(g, n):
        return pages_with_cuts(g, n, cut_tokens(fit.groups), fit.cut_groups)
    assert all(pages(g, cap) <= args.prefill.num_pages for g in fit.groups)
    assert any(pages(g, cap + 1) > args.prefill.num_pages for g in fit.groups)
    assert fit.fit(args.prefill.num_pages * 64 + 300, 8, True, "prompt") == 8
    with pytest.raises(ContextLengthExceeded, match="prefill replica's page pool has 16 pages in each of") as e:
        fit.fit(cap + 1, 1, True, "prompt")
    assert e.value.param == "prompt"
