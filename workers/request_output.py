"""What one request produced in one engine step, and its wire form between processes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    """What one request produced in one step (``token_ids`` may be empty).

    top_logprobs: one ``{token id: logprob}`` per token, when the request
    asked for top log-probabilities (``SamplingParams.logprobs`` > 0).
    prompt_logprobs / prompt_top_logprobs: on the request's first output when it
    asked (``SamplingParams.prompt_logprobs``): one value / top dict per prompt
    position, None at position 0 (`workers.sample.prompt_logprobs`)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None

    def to_wire(self) -> tuple:
        """Builtins only, in field order: Ray serializes a tuple with msgpack, a
        dataclass with cloudpickle (1.4 us vs 18 us per item here, and the decode
        replica sends one item per request per step). ``top_logprobs``' dicts go
        as ``[[id, logprob], ...]`` since msgpack maps want string keys."""
        top = None if self.top_logprobs is None else [[[k, v] for k, v in d.items()] for d in self.top_logprobs]
        ptop = None if self.prompt_top_logprobs is None else \
            [None if d is None else [[k, v] for k, v in d.items()] for d in self.prompt_top_logprobs]
        return (self.request_id, self.token_ids, self.logprobs, self.finished, self.finish_reason, self.error, top,
                self.prompt_logprobs, ptop)

    @classmethod
    def from_wire(cls, wire: tuple | list) -> "RequestOutput":
        """The output `to_wire` encoded (a list too: some transports turn tuples into lists)."""
        rid, ids, lps, finished, reason, error, top, plps, ptop = wire
        top = None if top is None else [{int(k): v for k, v in pairs} for pairs in top]
        ptop = None if ptop is None else [None if p is None else {int(k): v for k, v in p} for p in ptop]
        return cls(rid, list(ids), list(lps), finished, reason, error, top, None if plps is None else list(plps), ptop)
