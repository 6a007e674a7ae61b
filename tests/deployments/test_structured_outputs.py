"""Structured outputs at the API, without a server: the request fields, their 400s, and the forced
tool-call grammars against the family parsers (DeepSeek's DSML, GLM-5's tags) on the tiny
checkpoints' real tokenizers.

A forced call's grammar is checked from both sides: random walks through it (a uniformly random
allowed token each step: anything the grammar lets any model write) always parse into tool calls
whose arguments validate against the function's schema, streamed or not, and finish
``tool_calls`` as the ingress assembles the reply; and the markup the family's own encoder writes
for a valid call is accepted by it. A new grammar compiles off the ingress's event loop.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from deployments.openai.errors import InvalidRequest, OpenAIError
from deployments.openai.protocol import parse_request
from deployments.openai.render.deepseek_v32 import encode_tool_calls
from deployments.openai.chat_output import ChatOutput
from deployments.openai.structured import constrain, constrain_off_loop, strict_schema
from deployments.openai.tools import tool_parser_for
from deployments.text_stream import TextStream
from models.tiny import _byte_alphabet
from models.tiny_native import GLM5_CHAT_TEMPLATE, make_native_tokenizer
from tests.workers.test_grammar_mask import walk
from workers.sample.params import SamplingParams
from workers.engine import RequestOutput
from workers.structured import GrammarCompiler

SEED = random.SystemRandom().randrange(1 << 31)

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Oslo", "Paris", "Rio de Janeiro"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "units": {"enum": ["C", "F"]},
    "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "maxItems": 3},
    "code": {"type": "string", "maxLength": 4},
}, "required": ["city", "days"]}
PING = {"type": "object", "properties": {"loud": {"type": "boolean"}}, "required": ["loud"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping", "parameters": PING}},
         {"type": "function", "function": {"name": "now"}}]
SCHEMAS = {"get_weather": WEATHER, "ping": PING, "now": {"type": "object"}}
USER = [{"role": "user", "content": "x"}]


@pytest.fixture(scope="module")
def compilers():
    """model_type -> a compiler over that family's tiny native tokenizer."""
    return {arch: GrammarCompiler(make_native_tokenizer(arch, _byte_alphabet(), 2048), 320, [257])
            for arch in ("deepseek_v32", "glm_moe_dsa")}


def params_for(body: dict, compiler, arch="deepseek_v32", kind="chat"):
    return constrain(parse_request(body, kind), SamplingParams(max_new_tokens=64), compiler, arch)


def refused(body: dict, compiler=None, kind="chat") -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        req = parse_request({"model": "m", **({"messages": USER} if kind == "chat" else {"prompt": "x"}), **body}, kind)
        if compiler is not None:
            constrain(req, SamplingParams(), compiler, "deepseek_v32")
    return e.value


# --------------------------------------------------------------------------- fields and 400s


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "extra": 1}}},
     "response_format.json_schema.extra"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    # A stop would cut a forced call's markup (it would end as content, finish "stop").
    ({"tools": TOOLS, "tool_choice": "required", "stop": ["\n"]}, "stop"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "ping"}}, "stop_token_ids": [10]},
     "stop_token_ids"),
])
def test_body_rules_name_the_field(body, param):
    e = refused(body)
    assert (e.status_code, e.param) == (400, param), e.message


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": {"properties": {"a": {"minimum": "zero"}}}}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"anyOf": [{"type": "object"}]}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools[0].function.parameters.required"),
])
def test_grammars_that_do_not_compile_name_the_field(compilers, body, param):
    e = refused(body, compilers["deepseek_v32"])
    assert (e.status_code, e.param) == (400, param), e.message


def test_a_server_without_llguidance_says_so_and_still_serves_unconstrained_requests(compilers, monkeypatch):
    """The first GPU host's carried wheels lacked llguidance: every constrained request was a 500 with a
    traceback in the log. Now a 500 that names the missing package; unconstrained requests are untouched."""
    from deployments.openai import structured

    monkeypatch.setattr(structured, "_grammar_engine_installed", lambda: False)
    req = parse_request({"model": "m", "prompt": "x", "structured_outputs": {"choice": ["a", "b"]}}, "completion")
    for call in (lambda: constrain(req, SamplingParams(), compilers["deepseek_v32"], "deepseek_v32"),
                 lambda: asyncio.run(constrain_off_loop(req, SamplingParams(), compilers["deepseek_v32"],
                                                        "deepseek_v32"))):
        with pytest.raises(OpenAIError) as e:
            call()
        assert (e.value.status_code, e.value.param, e.value.code) == (500, "structured_outputs", "grammar_engine_missing")
        assert "llguidance" in e.value.message
    plain = parse_request({"model": "m", "prompt": "x"}, "completion")
    assert asyncio.run(constrain_off_loop(plain, SamplingParams(), compilers["deepseek_v32"], "deepseek_v32")).grammar is None


def test_completions_take_structured_outputs(compilers):
    p = params_for({"model": "m", "prompt": "x", "structured_outputs": {"choice": ["a", "b"]}},
                   compilers["deepseek_v32"], kind="completion")
    assert p.grammar.kind == "choice"
    e = refused({"structured_outputs": {"regex": "("}}, compilers["deepseek_v32"], kind="completion")
    assert e.param == "structured_outputs.regex"
    assert params_for({"model": "m", "prompt": "x"}, compilers["deepseek_v32"], kind="completion").grammar is None


def test_strict_closes_objects_but_not_data():
    s = strict_schema({"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                                        "b": {"enum": [{"type": "object"}]},
                                                        "c": {"type": "object", "additionalProperties": True}}})
    assert s["additionalProperties"] is False and s["properties"]["a"]["additionalProperties"] is False
    assert s["properties"]["b"]["enum"] == [{"type": "object"}]
    assert s["properties"]["c"]["additionalProperties"] is True


def test_repeated_schemas_compile_once(compilers):
    c = GrammarCompiler(compilers["deepseek_v32"].tokenizer, 320, [257])
    body = {"model": "m", "messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "w", "strict": True, "schema": WEATHER}}}
    assert params_for(body, c).grammar == params_for(body, c).grammar and c.compiled == 1


# --------------------------------------------------------------------------- forced tool calls


def tool_body(choice, parallel=None):
    body = {"model": "m", "messages": USER, "tools": TOOLS, "tool_choice": choice}
    return body if parallel is None else {**body, "parallel_tool_calls": parallel}


def parse_both_ways(arch, text):
    """(content, calls) of ``text`` parsed whole, checked equal to parsing it character by character."""
    content, calls = tool_parser_for(arch)(TOOLS, new_id=lambda: "id").parse(text)
    streamed = tool_parser_for(arch)(TOOLS, new_id=lambda: "id")
    pieces = [streamed.feed(ch) for ch in text] + [streamed.finish()]
    args: dict[int, str] = {}
    for _, deltas in pieces:
        for d in deltas:
            args[d.index] = args.get(d.index, "") + d.arguments
    assert "".join(c for c, _ in pieces) == content
    assert [args[i] for i in range(len(calls))] == [c.arguments for c in calls]
    return content, calls


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("choice, parallel, names", [
    ({"type": "function", "function": {"name": "get_weather"}}, None, {"get_weather"}),
    ("required", False, {"get_weather", "ping", "now"}),
    ("required", None, {"get_weather", "ping", "now"}),
])
def test_random_walks_of_a_forced_call_parse_and_validate(compilers, arch, choice, parallel, names):
    c = compilers[arch]
    spec = params_for(tool_body(choice, parallel), c, arch).grammar
    rng = random.Random(SEED)
    many = 0
    for _ in range(12):
        text = c.tokenizer.decode(walk(c, spec, rng, max_tokens=5000), skip_special_tokens=True)
        content, calls = parse_both_ways(arch, text)
        assert content.strip() == "" and calls, (SEED, text)
        assert len(calls) == 1 or (choice == "required" and parallel is None), (SEED, text)
        many += len(calls) > 1
        for call in calls:
            assert call.name in names
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_the_encoders_own_markup_is_in_the_grammar(compilers):
    """What DeepSeek's encoder and GLM-5's template write for a valid call (strings as text, the
    rest JSON; tokenized as the model sees it) is a sentence of the forced grammar."""
    args = {"city": "Rio de Janeiro", "days": 3, "hours": [1, 2], "code": "ab"}
    calls = [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}}]
    ds = compilers["deepseek_v32"]
    spec = params_for(tool_body({"type": "function", "function": {"name": "get_weather"}}), ds).grammar
    m = ds.matcher(spec)
    m.sync(ds.tokenizer(encode_tool_calls(calls), add_special_tokens=False)["input_ids"])
    assert m.error is None and m.done
    # A plain string parameter is DeepSeek's string="true" text, up to its closing tag.
    free = {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
    spec = params_for({"model": "m", "messages": USER, "tools": [free], "tool_choice": "required"}, ds).grammar
    m = ds.matcher(spec)
    note = [{"id": "c", "type": "function", "function": {"name": "note", "arguments": '{"text": "a <b> \\"c\\"\\n"}'}}]
    m.sync(ds.tokenizer(encode_tool_calls(note), add_special_tokens=False)["input_ids"])
    assert m.error is None and m.done

    import jinja2

    glm = compilers["glm_moe_dsa"]
    text = jinja2.Template(GLM5_CHAT_TEMPLATE).render(messages=[{"role": "assistant", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": args}}]}])
    text = text[text.index("<tool_call>"):]
    spec = params_for(tool_body({"type": "function", "function": {"name": "get_weather"}}), glm, "glm_moe_dsa").grammar
    m = glm.matcher(spec)
    m.sync(glm.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert m.error is None and m.done, text


def test_glm_string_keywords_it_cannot_write_are_refused(compilers):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "^a+$"}}}}}]
    body = parse_request({"model": "m", "messages": USER, "tools": tools, "tool_choice": "required"}, "chat")
    with pytest.raises(InvalidRequest) as e:
        constrain(body, SamplingParams(), compilers["glm_moe_dsa"], "glm_moe_dsa")
    assert e.value.param == "tools[0].function.parameters.properties.s"
    # DeepSeek writes such a value as JSON (string="false"): no refusal there.
    assert constrain(body, SamplingParams(), compilers["deepseek_v32"], "deepseek_v32").grammar is not None


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def answer(arch, compiler, body, ids: list[int], engine_finish: str):
    """The reply the ingress assembles (`deployments.ingress._ClientRequest`) from engine outputs carrying
    ``ids`` three tokens at a time, the last one finished with ``engine_finish``: (each streamed
    chunk's finish_reason, the non-streamed response's finish_reason, its message)."""
    from deployments.ingress import _ClientRequest
    from deployments.metrics.ingress import IngressMetrics

    chat = ChatOutput(TextStream(compiler.tokenizer, body.stop_sequences), None,
                      tool_parser_for(arch)(body.tool_dicts()), parallel_tool_calls=body.parallel_tool_calls is not False)
    job = _ClientRequest("chat", body, [1], compiler.tokenizer, IngressMetrics("m").start(), chat)
    chunks = []
    for i in range(0, len(ids), 3):
        last = i + 3 >= len(ids)
        job.take(RequestOutput("r", ids[i:i + 3], [0.0] * len(ids[i:i + 3]), last, engine_finish if last else None))
        chunks.append(job.finish_reason)  # what `_events` puts on this output's chunk
    return chunks, job.finish_reason, chat.message()


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_a_forced_call_finishes_tool_calls_streamed_and_not(compilers, arch, choice):
    """Whatever a model writes under a forced call's grammar (random walks through it) ends, once the
    grammar is complete (the engine's ``stop``), as ``finish_reason: "tool_calls"`` on the last chunk
    and in the response, with the calls and no content; cut by max_tokens it ends ``length``."""
    c = compilers[arch]
    body = parse_request(tool_body(choice), "chat")
    spec = params_for(tool_body(choice), c, arch).grammar
    rng = random.Random(SEED)
    for _ in range(4):
        ids = walk(c, spec, rng, max_tokens=5000)
        chunks, finish, msg = answer(arch, c, body, ids, "stop")
        assert chunks[-1] == finish == "tool_calls" and set(chunks[:-1]) == {None}, (SEED, ids)
        assert msg.tool_calls and not (msg.content or "").strip(), (SEED, ids)
        assert all(t.function.name in (SCHEMAS if choice == "required" else {"get_weather"})
                   for t in msg.tool_calls)
        chunks, finish, _ = answer(arch, c, body, ids[: len(ids) // 2], "length")
        assert chunks[-1] == finish == "length"


def test_a_slow_compile_leaves_the_event_loop_free(compilers):
    """A new large schema compiles on a thread (`constrain_off_loop`, as the ingress calls it): while it
    compiles, an unconstrained request and one whose schema is already compiled are answered on the
    event loop at once; then the slow one gets the grammar `constrain` gives."""
    c = GrammarCompiler(compilers["deepseek_v32"].tokenizer, 320, [257])
    big = {"type": "object", "required": [f"k{i}" for i in range(2500)], "properties": {
        f"k{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{i % 11 + 9}}}[0-9]+$"} for i in range(2500)}}
    slow = parse_request({"model": "m", "messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "big", "schema": big}}}, "chat")
    cached = parse_request({"model": "m", "messages": USER, "response_format": {"type": "json_object"}}, "chat")
    free = parse_request({"model": "m", "messages": USER}, "chat")
    params = SamplingParams(max_new_tokens=64)
    warm = constrain(cached, params, c, "deepseek_v32")  # builds llguidance's tokenizer and caches json_object
    timed = {}

    def compile_timed(*args):
        t = time.perf_counter()
        try:
            return constrain(*args)
        finally:
            timed["compile"] = time.perf_counter() - t

    async def main():
        with ThreadPoolExecutor(2) as pool:
            loop = asyncio.get_running_loop()
            # The slow request's compile, timed on its thread (the code path constrain_off_loop takes for it).
            slow_task = asyncio.ensure_future(constrain_off_loop(slow, params, c, "deepseek_v32", executor=pool))
            await asyncio.sleep(0)  # it has handed its compile to a thread
            t0 = time.perf_counter()
            got_free = await constrain_off_loop(free, params, c, "deepseek_v32", executor=pool)
            got_cached = await constrain_off_loop(cached, params, c, "deepseek_v32", executor=pool)
            others = time.perf_counter() - t0
            pending = not slow_task.done()
            got_slow = await slow_task
            # The same compile on the loop would stall it for its whole duration.
            again = GrammarCompiler(c.tokenizer, 320, [257])
            await loop.run_in_executor(pool, compile_timed, slow, params, again, "deepseek_v32")
        return got_free, got_cached, got_slow, others, pending

    got_free, got_cached, got_slow, others, pending = asyncio.run(main())
    assert got_free is params and got_cached.grammar == warm.grammar
    assert pending, "the slow compile finished before the others were answered: it ran on the loop"
    assert got_slow.grammar == constrain(slow, params, c, "deepseek_v32").grammar and c.is_compiled(got_slow.grammar)
    assert others < timed["compile"] / 4, (others, timed)
