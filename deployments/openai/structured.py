"""Structured outputs at the API: the request fields that constrain a reply, turned into a `GrammarSpec`.

Sources (at most one per request; a second is a 400 naming it):

- ``response_format`` (chat): ``json_object`` (any JSON object) or
  ``json_schema`` (``{"name", "schema", "strict"}``; ``strict: true`` also
  closes every object schema that does not say otherwise —
  ``additionalProperties: false`` — as OpenAI's strict mode requires);
- ``tool_choice`` (chat) ``required`` or ``{"type": "function", "function":
  {"name"}}``: the reply is a block of tool calls in the model family's markup
  (`deployments.openai.tools.grammar`), parsed back into ``tool_calls``, and
  finishes ``tool_calls`` (``length`` when ``max_tokens`` cuts it); ``stop`` /
  ``stop_token_ids`` are refused with it (they would cut the markup);
- ``structured_outputs`` (both endpoints, vLLM's extension): exactly one of
  ``json`` (a schema, as an object or JSON text), ``regex``, ``choice`` (a
  list of strings), ``grammar`` (Lark or GBNF), ``json_object: true``.

`check_structured` does the checks that need nothing but the body (called from
the request's ``check``); `constrain` compiles the grammar with the ingress's
`GrammarCompiler` (its errors are 400s naming the field, and the compiled
grammar is cached: the replicas compile the same text with the same
tokenizer) and puts it into the `SamplingParams`. The ingress calls it as
`constrain_off_loop`: compiling takes up to ~100 ms for a large schema (and
the first constrained request builds llguidance's view of the tokenizer,
about a second for a 128k vocabulary), which must not stall the event loop
that serves every other request. A chat reply that starts
inside a thinking block is constrained after ``</think>`` only
(`GrammarSpec.reasoning_end`). Free of Ray, like the rest of ``deployments.openai``.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import re
from concurrent.futures import Executor
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deployments.openai.errors import InvalidRequest, OpenAIError
from deployments.openai.tools.grammar import forced_tool_grammar
from workers.structured import GrammarCompiler, GrammarSpec

__all__ = ["StructuredOutputs", "check_structured", "constrain", "constrain_off_loop", "grammar_spec",
           "strict_schema"]

_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json",
                                                      description="A JSON schema (an object, or its JSON text).")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="A Lark (llguidance dialect) or GBNF grammar.")
    json_object: bool | None = None

    def given(self) -> list[str]:
        """The constraint fields set (``json_object: false`` is not one)."""
        out = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, "json_" if k == "json" else k)
               is not None]
        return out + (["json_object"] if self.json_object else [])


def _sources(body) -> list[str]:
    """The fields of ``body`` that ask for a constrained reply."""
    out = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type != "text":
        out.append("response_format")
    choice = getattr(body, "tool_choice", None)
    if getattr(body, "tools", None) and (choice == "required" or hasattr(choice, "function")):
        out.append("tool_choice")
    if getattr(body, "structured_outputs", None) is not None:
        out.append("structured_outputs")
    return out


@functools.cache
def _grammar_engine_installed() -> bool:
    return importlib.util.find_spec("llguidance") is not None


def _require_grammar_engine(fields: list[str]) -> None:
    """A constrained request on a server whose Python lacks llguidance (a dependency: a broken install,
    as the first GPU host's carried wheels were) is answered with this, not a traceback's 500; the
    server keeps serving unconstrained requests."""
    if fields and not _grammar_engine_installed():
        raise OpenAIError(f"{fields[0]}: structured outputs are unavailable on this server: its Python lacks "
                          "llguidance, a dependency of dsa-pd (pip install 'llguidance>=1.9,<2')",
                          param=fields[0], code="grammar_engine_missing")


def check_structured(body) -> None:
    """The body-only rules of structured outputs (module docstring); raises ``InvalidRequest``."""
    sources = _sources(body)
    if len(sources) > 1:
        raise InvalidRequest(f"{sources[0]} and {sources[1]} both constrain the reply: give one",
                             param=sources[1])
    if sources and body.min_tokens:
        # A complete grammar allows only EOS, which min_tokens blocks: no token would be left to sample.
        raise InvalidRequest(f"min_tokens cannot be combined with {sources[0]} (structured outputs)",
                             param="min_tokens")
    if sources == ["tool_choice"]:
        # A forced call's reply is its markup (newlines, tags) and ends as tool_calls; a stop string or
        # stop token would end it partway, as content, with finish_reason stop.
        for field in ("stop", "stop_token_ids"):
            if getattr(body, field):
                raise InvalidRequest(f"{field} cannot be combined with a forced tool call (tool_choice "
                                     f"'required' or a named function): it would cut the call's markup",
                                     param=field)
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        given = so.given()
        if len(given) != 1:
            raise InvalidRequest(f"structured_outputs takes exactly one of json, regex, choice, grammar, "
                                 f"json_object; got {given or 'none'}", param="structured_outputs")
        if so.choice is not None and (not so.choice or not all(so.choice)):
            raise InvalidRequest("structured_outputs.choice must be a non-empty list of non-empty strings",
                                 param="structured_outputs.choice")
        if isinstance(so.json_, str):
            _json_text(so.json_, "structured_outputs.json")
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type == "json_schema":
        js = fmt.json_schema
        if not isinstance(js, dict):
            raise InvalidRequest("response_format.json_schema is required for type 'json_schema'",
                                 param="response_format.json_schema")
        unknown = sorted(set(js) - {"name", "description", "schema", "strict"})
        if unknown:
            raise InvalidRequest(f"response_format.json_schema.{unknown[0]} is not a field of json_schema",
                                 param=f"response_format.json_schema.{unknown[0]}")
        if not isinstance(js.get("name"), str) or not _SCHEMA_NAME.match(js["name"]):
            raise InvalidRequest("response_format.json_schema.name must be 1-64 letters, digits, '_' or '-'",
                                 param="response_format.json_schema.name")
        if not isinstance(js.get("schema", {}), (dict, bool)):
            raise InvalidRequest("response_format.json_schema.schema must be a JSON schema (an object)",
                                 param="response_format.json_schema.schema")
        if not isinstance(js.get("strict", False), (bool, type(None))):
            raise InvalidRequest("response_format.json_schema.strict must be true or false",
                                 param="response_format.json_schema.strict")
    elif fmt is not None and fmt.json_schema is not None:
        raise InvalidRequest(f"response_format.json_schema is only allowed with type 'json_schema', not "
                             f"{fmt.type!r}", param="response_format.json_schema")


def _json_text(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(f"{param} is not valid JSON: {e}", param=param) from e


def strict_schema(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not set it
    (OpenAI's strict mode); values that are data (``enum``, ``const``, ``default``, ``examples``) are
    left as they are."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("enum", "const", "default", "examples") else strict_schema(v)) for k, v in schema.items()}
    if ("properties" in out or out.get("type") == "object") and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_spec(body, compiler: GrammarCompiler, model_type: str, reasoning_end: str | None = None
                 ) -> tuple[GrammarSpec, str] | None:
    """(the spec, the field it comes from) of a constrained request, None for an unconstrained one.
    Raises ``InvalidRequest`` for a tool schema the markup cannot force."""
    sources = _sources(body)
    if not sources:
        return None
    src = sources[0]
    if src == "response_format":
        fmt = body.response_format
        if fmt.type == "json_object":
            return GrammarSpec.json_schema({"type": "object"}, reasoning_end), "response_format"
        js = fmt.json_schema
        schema = js.get("schema", {})
        if js.get("strict"):
            schema = strict_schema(schema)
        return GrammarSpec.json_schema(schema, reasoning_end), "response_format.json_schema.schema"
    if src == "tool_choice":
        tools = body.tool_dicts()
        name = None if body.tool_choice == "required" else body.tool_choice.function.name
        lark = forced_tool_grammar(model_type, tools, name, body.parallel_tool_calls is not False, compiler)
        return GrammarSpec("lark", lark, reasoning_end), "tools"
    so = body.structured_outputs
    kind = so.given()[0]
    if kind == "json":
        schema = _json_text(so.json_, "structured_outputs.json") if isinstance(so.json_, str) else so.json_
        return GrammarSpec.json_schema(schema, reasoning_end), "structured_outputs.json"
    if kind == "json_object":
        return GrammarSpec.json_schema({"type": "object"}, reasoning_end), "structured_outputs.json_object"
    if kind == "choice":
        return GrammarSpec.choice(so.choice, reasoning_end), "structured_outputs.choice"
    return GrammarSpec(kind, getattr(so, kind), reasoning_end), f"structured_outputs.{kind}"


def _reasoning_end(chat) -> str | None:
    """The closing tag of the thinking block a chat reply starts inside (None: it starts with content)."""
    reasoning = getattr(chat, "reasoning_parser", None)
    return reasoning.end_tag if reasoning is not None and reasoning.in_reasoning else None


def _with_grammar(params, found: tuple[GrammarSpec, str] | None, compiler: GrammarCompiler):
    """``params`` with the grammar of ``found`` (`grammar_spec`'s answer), compiled (a 400 naming its
    field when it does not compile); ``params`` itself when ``found`` is None."""
    if found is None:
        return params
    spec, param = found
    error = compiler.validate(spec)
    if error:
        raise InvalidRequest(f"{param}: the grammar does not compile: {error}", param=param)
    return replace(params, grammar=spec)


def constrain(body, params, compiler: GrammarCompiler, model_type: str, chat=None):
    """``params`` (`SamplingParams`) with the request's grammar, compiled once here so that a bad one
    is a 400 naming its field; ``params`` itself for an unconstrained request. chat: the chat reply's
    `ChatOutput` (a reply that starts inside a thinking block is constrained after it). Blocks while
    it compiles: on an event loop, use `constrain_off_loop`."""
    _require_grammar_engine(_sources(body))
    return _with_grammar(params, grammar_spec(body, compiler, model_type, _reasoning_end(chat)), compiler)


async def constrain_off_loop(body, params, compiler: GrammarCompiler, model_type: str, chat=None,
                             executor: Executor | None = None):
    """`constrain`, with the slow parts on ``executor``'s threads (None: the loop's default executor;
    llguidance releases the GIL while it compiles) so that the event loop keeps serving other requests.

    An unconstrained request never leaves the loop, nor does one whose grammar is already compiled
    (the common case: clients send the same schema or tools on every request): writing a grammar's
    text is cheap once llguidance's tokenizer exists. A new grammar compiles on a thread, and so does
    the first constrained request's whole `constrain` (it builds that tokenizer)."""
    fields = _sources(body)
    if not fields:
        return params
    _require_grammar_engine(fields)
    loop = asyncio.get_running_loop()
    if not compiler.tokenizer_ready:
        return await loop.run_in_executor(executor, constrain, body, params, compiler, model_type, chat)
    found = grammar_spec(body, compiler, model_type, _reasoning_end(chat))
    if found is None or compiler.is_compiled(found[0]):
        return _with_grammar(params, found, compiler)  # a cache hit: nothing to compile
    return await loop.run_in_executor(executor, _with_grammar, params, found, compiler)
