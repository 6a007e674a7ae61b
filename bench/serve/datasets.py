"""The requests a benchmark sends: prompt (text or token ids) and output length.

* ``random``: prompt lengths uniform in ``[L*(1-r), L*(1+r)]`` (``L`` =
  ``--random-input-len``, ``r`` = ``--random-range-ratio``), output lengths the
  same way around ``--random-output-len``; token ids uniform in
  ``[offset, offset + vocab_size)`` (``--random-token-offset``,
  ``--random-vocab-size``), sent as a list of ints: no tokenizer is needed.
* ``fixed``: one random prompt of exactly ``L`` tokens sent ``num_prompts``
  times, each asking for exactly ``--random-output-len`` tokens (same request
  over and over: run-to-run comparisons, determinism checks).
* ``jsonl``: one JSON object per line: ``"prompt"`` (a string or a list of
  token ids) and optionally ``"output_len"`` (default ``--random-output-len``).
  Lines are used in order, from the start again if ``num_prompts`` is larger.
* ``prefix_repetition``, ``multi_turn``: prompts that repeat prefixes
  (``bench.serve.prefix_workloads``).

Lengths are in tokens. A text prompt's token count is unknown here
(``prompt_len`` None) until the server's ``usage`` says it.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("random", "fixed", "jsonl", "prefix_repetition", "multi_turn")


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int | None  # tokens; None for a text prompt
    output_len: int         # tokens asked for (max_tokens)
    follows: int | None = None
    """Index of the request (in the same list) that must have finished before this one is sent (the turn
    before, in ``multi_turn``); None: sent at its arrival time."""


def _length_range(length: int, ratio: float, what: str) -> tuple[int, int]:
    if length < 1:
        raise ValueError(f"--random-{what}-len must be >= 1, not {length}")
    if not 0 <= ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), not {ratio}")
    return max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    vocab_size: int = 256, token_offset: int = 0, seed: int = 0) -> list[SampleRequest]:
    if vocab_size < 1 or token_offset < 0:
        raise ValueError("--random-vocab-size must be >= 1 and --random-token-offset >= 0")
    rng = random.Random(seed)
    in_lo, in_hi = _length_range(input_len, range_ratio, "input")
    out_lo, out_hi = _length_range(output_len, range_ratio, "output")
    out = []
    for _ in range(num_prompts):
        n = rng.randint(in_lo, in_hi)
        ids = [token_offset + rng.randrange(vocab_size) for _ in range(n)]
        out.append(SampleRequest(ids, n, rng.randint(out_lo, out_hi)))
    return out


def fixed_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int = 256,
                   token_offset: int = 0, seed: int = 0) -> list[SampleRequest]:
    one = random_requests(1, input_len, output_len, 0.0, vocab_size, token_offset, seed)[0]
    return [one] * num_prompts


def _jsonl_line(obj, where: str, default_output_len: int) -> SampleRequest:
    if not isinstance(obj, dict) or "prompt" not in obj:
        raise ValueError(f"{where}: expected an object with a \"prompt\"")
    prompt = obj["prompt"]
    if isinstance(prompt, str):
        n = None
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        n = len(prompt)
    else:
        raise ValueError(f"{where}: \"prompt\" must be a string or a non-empty list of token ids")
    out_len = obj.get("output_len", default_output_len)
    if not isinstance(out_len, int) or isinstance(out_len, bool) or out_len < 1:
        raise ValueError(f"{where}: \"output_len\" must be an integer >= 1")
    return SampleRequest(prompt, n, out_len)


def jsonl_requests(path: str | Path, num_prompts: int | None, default_output_len: int) -> list[SampleRequest]:
    """The first ``num_prompts`` requests of the file (cycling; all lines when None)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{no}: not JSON ({e})") from None
            rows.append(_jsonl_line(obj, f"{path}:{no}", default_output_len))
    if not rows:
        raise ValueError(f"{path} has no requests")
    if num_prompts is None:
        return rows
    return [rows[i % len(rows)] for i in range(num_prompts)]


WARMUP_SEED_OFFSET = 7_654_321
"""Warm-up prompts are drawn with ``--seed`` plus this: none is a timed prompt (or shares its prefix), so a
server with prefix caching does not start the timed run with some of its prompts cached."""


def warm_up_requests(args) -> list[SampleRequest]:
    """``--num-warmups`` requests of the same dataset and shape as the timed ones, from another seed (a
    ``jsonl`` dataset has one set of prompts: its first rows)."""
    if args.num_warmups <= 0:
        return []
    return build_requests(argparse.Namespace(**{**vars(args), "seed": args.seed + WARMUP_SEED_OFFSET,
                                                "num_prompts": args.num_warmups}))


def build_requests(args) -> list[SampleRequest]:
    """The requests of the parsed ``bench serve`` arguments."""
    name = args.dataset_name
    if name == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset-name jsonl needs --dataset-path FILE.jsonl")
        return jsonl_requests(args.dataset_path, args.num_prompts, args.random_output_len)
    n = 1000 if args.num_prompts is None else args.num_prompts
    if name == "random":
        return random_requests(n, args.random_input_len, args.random_output_len, args.random_range_ratio,
                               args.random_vocab_size, args.random_token_offset, args.seed)
    if name == "fixed":
        return fixed_requests(n, args.random_input_len, args.random_output_len, args.random_vocab_size,
                              args.random_token_offset, args.seed)
    if name == "prefix_repetition":
        from bench.serve.prefix_workloads import prefix_repetition_requests

        return prefix_repetition_requests(n, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
                                          args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len,
                                          args.random_vocab_size, args.random_token_offset, args.seed)
    if name == "multi_turn":
        from bench.serve.prefix_workloads import multi_turn_requests

        return multi_turn_requests(n, args.random_input_len, args.multi_turn_user_len, args.multi_turn_turns,
                                   args.random_output_len, args.random_vocab_size, args.random_token_offset,
                                   args.seed)
    raise ValueError(f"unknown --dataset-name {name!r}: one of {', '.join(DATASETS)}")
