"""Workloads whose prompts repeat prefixes: what a prefix cache is judged on (token ids, no tokenizer).

* ``prefix_repetition`` (as ``vllm bench serve --dataset-name
  prefix_repetition``): ``--prefix-repetition-num-prefixes`` random prefixes
  of ``--prefix-repetition-prefix-len`` tokens; request ``i`` is prefix
  ``i % num_prefixes`` followed by its own random suffix of
  ``--prefix-repetition-suffix-len`` tokens and asks for
  ``--prefix-repetition-output-len`` tokens; the requests are shuffled (seeded),
  so each prefix's first request is a miss and the rest can hit.
* ``multi_turn``: conversations of ``--multi-turn-turns`` turns. Turn 1 is a
  random first message of ``--random-input-len`` tokens; turn ``t + 1``'s
  prompt is turn ``t``'s prompt, a stand-in for its reply
  (``--random-output-len`` random tokens: the served reply is not fed back,
  so the load is reproducible) and a new user message of
  ``--multi-turn-user-len`` tokens. Each turn asks for ``--random-output-len``
  tokens and is sent only once the turn before it has finished
  (`SampleRequest.follows`), at its arrival time or then, whichever is later:
  a chat client's history re-sent, as a prefix cache sees it.

Token ids are drawn from ``[offset, offset + vocab_size)`` like the random
dataset's (``--random-token-offset``, ``--random-vocab-size``).
"""

from __future__ import annotations

import random

from bench.serve.datasets import SampleRequest


def _tokens(rng: random.Random, n: int, vocab_size: int, token_offset: int) -> list[int]:
    return [token_offset + rng.randrange(vocab_size) for _ in range(n)]


def _at_least(flag: str, n: int, lowest: int = 1) -> None:
    if n < lowest:
        raise ValueError(f"{flag} must be >= {lowest}, not {n}")


def prefix_repetition_requests(num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                               output_len: int, vocab_size: int = 256, token_offset: int = 0,
                               seed: int = 0) -> list[SampleRequest]:
    """``num_prompts`` requests over ``num_prefixes`` shared prefixes (module doc)."""
    _at_least("--prefix-repetition-prefix-len", prefix_len)
    _at_least("--prefix-repetition-suffix-len", suffix_len, 0)
    _at_least("--prefix-repetition-num-prefixes", num_prefixes)
    _at_least("--prefix-repetition-output-len", output_len)
    rng = random.Random(seed)
    prefixes = [_tokens(rng, prefix_len, vocab_size, token_offset) for _ in range(num_prefixes)]
    out = []
    for i in range(num_prompts):
        ids = prefixes[i % num_prefixes] + _tokens(rng, suffix_len, vocab_size, token_offset)
        out.append(SampleRequest(ids, len(ids), output_len))
    rng.shuffle(out)
    return out


def multi_turn_requests(num_prompts: int, first_len: int, user_len: int, turns: int, output_len: int,
                        vocab_size: int = 256, token_offset: int = 0, seed: int = 0) -> list[SampleRequest]:
    """``num_prompts`` turns of ``ceil(num_prompts / turns)`` conversations (the last one may be shorter),
    interleaved turn by turn (every conversation's turn 1 first); each turn `follows` its conversation's
    previous turn (module doc)."""
    _at_least("--random-input-len", first_len)
    _at_least("--multi-turn-user-len", user_len)
    _at_least("--multi-turn-turns", turns)
    _at_least("--random-output-len", output_len)
    rng = random.Random(seed)
    convs = -(-num_prompts // turns)
    histories = [_tokens(rng, first_len, vocab_size, token_offset) for _ in range(convs)]
    out: list[SampleRequest] = []
    last: list[int | None] = [None] * convs  # index in ``out`` of each conversation's latest turn
    for t in range(turns):
        for c in range(convs):
            if len(out) == num_prompts:
                return out
            if t:
                histories[c] = (histories[c] + _tokens(rng, output_len, vocab_size, token_offset)
                                + _tokens(rng, user_len, vocab_size, token_offset))
            out.append(SampleRequest(list(histories[c]), len(histories[c]), output_len, follows=last[c]))
            last[c] = len(out) - 1
    return out
