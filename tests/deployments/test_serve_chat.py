"""`serve run` of a tiny DeepSeek-V3.2 whose tokenizer is DeepSeek's (special tokens, **no chat
template**), PD mode, with the official `openai` client and the load generators' raw bodies.

One server for the module (starting one takes CPU-minutes here). Its app config turns thinking
on by default (``chat: {thinking: true}``), so requests exercise both the server default and the
per-request switches. The reference is the offline engine on the same checkpoint, fed prompts
rendered here with the native encoder: served replies must equal it token for token, split into
``reasoning_content`` / ``content`` at ``</think>`` as the offline text says.

Checked: chat in chat mode and thinking mode (non-streamed and streamed: reasoning deltas, then
content deltas); tool definitions and a tool-call history accepted; the exact bodies of ``vllm
bench serve`` and SGLang's ``bench_serving``, streamed and not; usage on every chunk with
``continuous_usage_stats``; ``logit_bias`` and ``min_tokens`` honoured on the device sampler;
structured outputs (``response_format`` ``json_schema`` in both modes, a named ``tool_choice``
forcing a DSML call that comes back as ``tool_calls`` streamed and not, ``structured_outputs`` on
completions), always valid, equal to the offline engine under the same grammar, and leaving the
unconstrained requests batched with them unchanged; refusals naming their field; the page pools
whole at the end. (The random tiny model never writes DSML on its own: unforced tool calls are
checked through the parsers fed token by token, tests/deployments/test_chat_parsers.py.)
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest

from deployments.app_config import AppConfig
from deployments.openai.protocol import parse_request
from deployments.openai.reasoning import DeepSeekV32ReasoningParser
from deployments.openai.render import DeepSeekV32Renderer, resolve_settings
from deployments.openai.structured import constrain
from deployments.openai.tools import DsmlToolParser
from models.config import load_config
from tests.deployments import bench_payloads as bp
from tests.deployments.app_fixtures import merged, yaml_args
from tests.deployments.offline_reference import reference_llm
from tests.deployments.serve_process import stats, wait_until
from tests.deployments.shared_servers import ServerSpec, server_fixture
from workers.sample.params import SamplingParams
from workers.structured import GrammarCompiler

pytestmark = pytest.mark.slow

RAW = merged(yaml_args("tiny_pd.yaml"), model={"tiny": {"arch": "deepseek_v32", "seed": 0, "tokenizer": "native"}},
             served_model_name="tiny-dsv32-native", chat={"thinking": True})
ARGS = AppConfig.model_validate(RAW)
MODEL = ARGS.model_name
N = 24  # tokens per reply (EOS ignored): every reference is N greedy tokens

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CHAT_MODE = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi!"},
             {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"},
             {"role": "user", "content": "Name a colour."}]
TOOL_HISTORY = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Cold, 2 degrees."}]
# Thinking-mode questions; the reference picks the first whose greedy reply closes its thinking
# block after a few tokens and goes on (the tiny model's lm_head favours </think> a little).
QUESTIONS = [f"Question {i}: what is {i}+{i}?" for i in range(16)]

# Structured outputs: bounded values, so that every reply of the random model ends by the grammar.
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}}, "required": ["colour", "n", "ok"]}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": SCHEMA}}
FORCED_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"]}}}, TOOLS[0] | {"function": {**TOOLS[0]["function"], "name": "other"}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "Answer in JSON."}]
SO_CHOICE = ["yes", "no", "maybe so"]
MAX_SO = 200  # tokens: more than any of these grammars' sentences take (the tokenizer is byte-level)


def rendered(tok, messages, tools=None, thinking=None) -> list[int]:
    text = DeepSeekV32Renderer().render(messages, tools, resolve_settings(None, None, thinking)).text
    return tok(text, add_special_tokens=False)["input_ids"]


class Ref:
    """Offline greedy replies (``N`` tokens, EOS ignored) of the prompts the tests send."""

    def __init__(self, llm, tok):
        self.tok = tok
        self.think_end = tok.convert_tokens_to_ids("</think>")
        self.ids = {
            "chat": rendered(tok, CHAT_MODE, thinking=False),
            "tools": rendered(tok, TOOL_HISTORY, TOOLS, thinking=False),
            "bench": tok("Benchmark prompt")["input_ids"],
            **{q: rendered(tok, [{"role": "user", "content": q}], thinking=True) for q in QUESTIONS},
        }
        names = list(self.ids)
        self.out = dict(zip(names, llm.generate([self.ids[n] for n in names], max_new_tokens=N, ignore_eos=True)))
        self.question = next((q for q in QUESTIONS if self.think_end in self.out[q][2:N - 2]), None)
        assert self.question, "no question's greedy reply closes its thinking block mid-way: pick other questions"
        self.structured(llm)

    def structured(self, llm):
        """Offline replies under the grammars the ingress makes of the structured requests below."""
        cfg = load_config(llm.model_dir)
        grammars = GrammarCompiler(self.tok, cfg.vocab_size, cfg.eos_token_ids)

        def spec(body, thinking=False):
            chat = SimpleNamespace(reasoning_parser=DeepSeekV32ReasoningParser(True)) if thinking else None
            req = parse_request({"model": MODEL, **body}, "chat" if "messages" in body else "completion")
            return constrain(req, SamplingParams(), grammars, "deepseek_v32", chat).grammar

        q = [{"role": "user", "content": self.question}]
        cases = {  # name: (prompt ids, body)
            "json": (rendered(self.tok, ASK, thinking=False), {"messages": ASK, "response_format": JSON_FORMAT}),
            "json_think": (self.ids[self.question], {"messages": q, "response_format": JSON_FORMAT}),
            "tool": (rendered(self.tok, ASK, FORCED_TOOLS, thinking=False),
                     {"messages": ASK, "tools": FORCED_TOOLS, "tool_choice": NAMED}),
            "choice": (self.ids["bench"], {"prompt": "x", "structured_outputs": {"choice": SO_CHOICE}}),
        }
        names = list(cases)
        outs = llm.generate([cases[n][0] for n in names], max_new_tokens=MAX_SO,
                            grammar=[spec(cases[n][1], n == "json_think") for n in names])
        self.out.update(zip(names, outs))
        self.ids.update({n: cases[n][0] for n in names})

    def text(self, name: str) -> str:
        return self.tok.decode(self.out[name], skip_special_tokens=True)

    def split(self, name: str) -> tuple[str, str]:
        """(reasoning, content) of a thinking-mode reply, cut at its first </think> token."""
        out = self.out[name]
        at = out.index(self.think_end)
        dec = lambda ids: self.tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        return dec(out[:at]), dec(out[at + 1:])


SERVER = ServerSpec("serve-chat", args=RAW, config_name="chat.yaml")
server = server_fixture(SERVER)


@pytest.fixture(scope="module")
def ref(server):
    """Computed while the server starts."""
    with reference_llm(ARGS) as (llm, tok, model_dir):
        assert tok.chat_template is None  # as the DeepSeek-V3.2 release: chat needs the native encoder
        yield Ref(llm, tok)


@pytest.fixture(scope="module")
def ready(server, ref):
    server.wait_ready(timeout=300)
    return server


@pytest.fixture(scope="module")
def client(ready):
    return openai.OpenAI(base_url=ready.url + "/v1", api_key="unused", max_retries=0, timeout=120)


IGNORE_EOS = {"ignore_eos": True}


def sse(resp: httpx.Response) -> list[dict]:
    """The JSON events of a server-sent-events body, [DONE] checked and dropped."""
    lines = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


# --------------------------------------------------------------------------- chat, both modes


def test_chat_mode_equals_offline(client, ref):
    """Thinking off per request (three spellings): the reply is all content, the prompt the native encoder's."""
    for switch in ({"chat_template_kwargs": {"thinking": False}}, {"chat_template_kwargs": {"thinking_mode": "chat"}},
                   {"reasoning_effort": "none"}):
        r = client.chat.completions.create(model=MODEL, messages=CHAT_MODE, max_tokens=N, temperature=0,
                                           extra_body={**IGNORE_EOS, **switch})
        msg = r.choices[0].message
        assert (msg.content, msg.model_extra.get("reasoning_content")) == (ref.text("chat"), None), switch
        assert r.usage.prompt_tokens == len(ref.ids["chat"]) and r.choices[0].finish_reason == "length"


def test_thinking_mode_by_server_default_splits_reasoning(client, ref):
    q = ref.question
    reasoning, content = ref.split(q)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=N, temperature=0,
              extra_body=IGNORE_EOS)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert (msg.model_extra["reasoning_content"], msg.content) == (reasoning, content)
    assert r.usage.prompt_tokens == len(ref.ids[q])
    # Streamed: every reasoning delta comes before the first content delta; they join up the same.
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    kinds = [k for d in deltas for k in (("r",) if d.model_extra.get("reasoning_content") else ())
             + (("c",) if d.content else ())]
    assert kinds == sorted(kinds, key=lambda k: k == "c") and "r" in kinds and "c" in kinds
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    assert chunks[-1].choices[0].finish_reason == "length"
    # include_reasoning: false drops the reasoning, the content is the same.
    r = client.chat.completions.create(**{**kw, "extra_body": {**IGNORE_EOS, "include_reasoning": False}})
    assert (r.choices[0].message.model_extra["reasoning_content"], r.choices[0].message.content) == (None, content)


def test_tools_and_a_tool_call_history_are_accepted(client, ref):
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model=MODEL, messages=TOOL_HISTORY, tools=TOOLS, tool_choice=choice,
                                           max_tokens=N, temperature=0,
                                           extra_body={**IGNORE_EOS, "chat_template_kwargs": {"thinking": False}})
        c = r.choices[0]
        # The random model writes no DSML: its reply is content, equal to the offline one.
        assert (c.message.content, c.message.tool_calls or [], c.finish_reason) == (ref.text("tools"), [], "length")
        assert r.usage.prompt_tokens == len(ref.ids["tools"])


# --------------------------------------------------------------------------- the load generators


def test_vllm_bench_serve_bodies(ready, ref):
    text = ref.text("bench")
    body = bp.vllm_completions(MODEL, "Benchmark prompt", N, extra_body=bp.VLLM_SAMPLING_FLAGS)
    events = sse(httpx.post(ready.url + "/v1/completions", json=body, timeout=120).raise_for_status())
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == text
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == N
    body = bp.vllm_chat(MODEL, "Benchmark prompt", N, extra_body={"temperature": 0.0})
    events = sse(httpx.post(ready.url + "/v1/chat/completions", json=body, timeout=120).raise_for_status())
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0]["role"] == "assistant" and events[-1]["usage"]["completion_tokens"] == N
    # vllm bench counts content; the server default thinks, so the text arrives as reasoning here.
    assert "".join(d.get("reasoning_content", "") + d.get("content", "") for d in deltas)


def test_sglang_bench_serving_bodies_streamed_and_not(ready, ref):
    text = ref.text("bench")
    r = httpx.post(ready.url + "/v1/completions", timeout=120,
                   json=bp.sglang_completions(MODEL, "Benchmark prompt", N, stream=False)).raise_for_status().json()
    assert r["choices"][0]["text"] == text and r["usage"]["completion_tokens"] == N
    events = sse(httpx.post(ready.url + "/v1/completions", timeout=120,
                            json=bp.sglang_completions(MODEL, "Benchmark prompt", N)).raise_for_status())
    assert "".join(e["choices"][0]["text"] for e in events) == text
    for body in (bp.sglang_chat(MODEL, "Hello", N, stream=False), bp.sglang_chat_legacy(MODEL, "Hello", N, False)):
        r = httpx.post(ready.url + "/v1/chat/completions", json=body, timeout=120).raise_for_status().json()
        assert r["choices"][0]["message"]["role"] == "assistant" and r["usage"]["completion_tokens"] >= 1
    events = sse(httpx.post(ready.url + "/v1/chat/completions", timeout=120,
                            json=bp.sglang_chat(MODEL, "Hello", N)).raise_for_status())
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_usage_on_every_chunk(client, ref):
    chunks = list(client.completions.create(model=MODEL, prompt=ref.ids["bench"], max_tokens=N, temperature=0,
                                            stream=True, extra_body=IGNORE_EOS,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage.prompt_tokens == len(ref.ids["bench"]) for c in chunks)
    assert counts == sorted(counts) and counts[-1] == N and len(set(counts)) > 2
    assert chunks[-1].choices == []  # include_usage's own last chunk as well


# --------------------------------------------------------------------------- sampler fields


def test_logit_bias_and_min_tokens_are_honoured(client, ref):
    eos = ref.tok.eos_token_id
    # EOS pushed to the top ends the reply at once; min_tokens holds it off for 4 tokens (PD: the
    # first of them is sampled on the prefill replica).
    kw = dict(model=MODEL, prompt=ref.ids["bench"], max_tokens=N, temperature=0)
    r = client.completions.create(**kw, logit_bias={str(eos): 100})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (1, "stop")
    r = client.completions.create(**kw, logit_bias={str(eos): 100}, extra_body={"min_tokens": 4})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (5, "stop")
    r = client.completions.create(**kw, logit_bias={str(ord("A")): 100}, extra_body=IGNORE_EOS)
    assert r.choices[0].text == "A" * N


# --------------------------------------------------------------------------- structured outputs


def test_json_schema_replies_validate_and_equal_offline(client, ref):
    """``response_format`` json_schema (strict), chat mode and thinking mode (the server default: the
    reasoning is free, the content after ``</think>`` the schema's), streamed and not."""
    off = {"chat_template_kwargs": {"thinking": False}}
    for name, messages, extra in (("json", ASK, off), ("json_think", [{"role": "user", "content": ref.question}], {})):
        kw = dict(model=MODEL, messages=messages, max_tokens=MAX_SO, temperature=0, response_format=JSON_FORMAT,
                  extra_body=extra)
        r = client.chat.completions.create(**kw)
        msg, want = r.choices[0].message, ref.text(name)
        if name == "json_think":
            reasoning, want = want.split("</think>", 1)
            assert msg.model_extra["reasoning_content"] == reasoning == ref.split(ref.question)[0]
        assert (msg.content, r.choices[0].finish_reason) == (want, "stop")
        jsonschema.validate(json.loads(msg.content), SCHEMA)
        chunks = list(client.chat.completions.create(**kw, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_named_tool_choice_forces_a_valid_dsml_call(client, ref):
    """The reply is DSML markup (the grammar writes what DeepSeek's format says) and comes back as
    ``tool_calls`` whose arguments validate against the function's parameters, streamed and not."""
    content, calls = DsmlToolParser(FORCED_TOOLS).parse(ref.text("tool"))
    assert [c.name for c in calls] == ["get_weather"] and content.strip() == ""
    kw = dict(model=MODEL, messages=ASK, tools=FORCED_TOOLS, tool_choice=NAMED, max_tokens=MAX_SO, temperature=0,
              extra_body={"chat_template_kwargs": {"thinking": False}})
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and not c.message.content
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == \
        [("get_weather", calls[0].arguments)]
    jsonschema.validate(json.loads(calls[0].arguments), FORCED_TOOLS[0]["function"]["parameters"])
    deltas = [d for ch in client.chat.completions.create(**kw, stream=True) if ch.choices
              for d in ch.choices[0].delta.tool_calls or ()]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call")
    assert "".join(d.function.arguments or "" for d in deltas) == calls[0].arguments


def test_constrained_requests_leave_batched_unconstrained_ones_unchanged(client, ref):
    """Unconstrained completions sent together with constrained chat and completion requests (so
    they share decode steps) answer exactly what they answer alone; the constrained ones answer the
    offline engine's constrained replies."""
    def free(_):
        return client.completions.create(model=MODEL, prompt=ref.ids["bench"], max_tokens=N, temperature=0,
                                         extra_body=IGNORE_EOS).choices[0].text

    def json_chat(_):
        return client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=MAX_SO, temperature=0,
                                              response_format=JSON_FORMAT,
                                              extra_body={"chat_template_kwargs": {"thinking": False}})

    def choice(_):
        return client.completions.create(model=MODEL, prompt=ref.ids["bench"], max_tokens=MAX_SO, temperature=0,
                                         extra_body={"structured_outputs": {"choice": SO_CHOICE}})

    jobs = [free, json_chat, free, choice, free]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda f: f(None), jobs))
    assert [got[0], got[2], got[4]] == [ref.text("bench")] * 3
    assert got[1].choices[0].message.content == ref.text("json")
    assert (got[3].choices[0].text, got[3].choices[0].finish_reason) == (ref.text("choice"), "stop")
    assert ref.text("choice") in SO_CHOICE


@pytest.mark.parametrize("kind, fields, param", [
    ("completion", {"best_of": 2}, "best_of"),
    ("completion", {"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ("completion", {"logit_bias": {"100000": 1}}, "logit_bias"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema"),
    ("chat", {"tools": TOOLS, "tool_choice": "required", "min_tokens": 2}, "min_tokens"),
    ("completion", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ("chat", {"chat_template_kwargs": {"enable_thinking": True, "thinking_mode": "chat"}},
     "chat_template_kwargs.thinking_mode"),
    ("chat", {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    ("chat", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "messages[1].role"),
])
def test_refusals_name_their_field(ready, kind, fields, param):
    base = {"model": MODEL, "max_tokens": 4}
    base |= {"prompt": "x"} if kind == "completion" else {"messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(ready.url + ("/v1/completions" if kind == "completion" else "/v1/chat/completions"),
                   json=base | fields, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error", param), err


def test_pools_end_where_they_started(ready):
    whole = (ARGS.prefill.num_pages, ARGS.decode.num_pages - 1)  # decode keeps prefill's warm-up page

    def free():
        s = stats(ready)
        return s["prefill"][0]["stats"]["free_pages"], s["decode"][0]["stats"]["free_pages"]
    wait_until(lambda: free() == whole, 30, "both pools back at their start counts")
