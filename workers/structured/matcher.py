"""One request's grammar state (`GrammarMatcher`) and a batch's bitmasks in the making (`MaskJob`)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import torch

from workers.host_copy import tensor_on
from workers.sample.ops.grammar_mask import GrammarMask


class GrammarMatcher:
    """A request's position in its grammar: an llguidance matcher fed the request's tokens in order.

    `sync` takes the request's whole output so far and consumes what is new, so a matcher made
    late (on a decode replica, after prefill sampled token 1; or after a preemption) replays what
    was generated before it existed: the grammar state is always a function of the tokens alone.
    """

    def __init__(self, ll):
        self.ll = ll
        self.consumed = 0

    def sync(self, tokens: Sequence[int]) -> None:
        """Consume ``tokens[self.consumed:]`` (a refused token leaves the matcher in error)."""
        if len(tokens) > self.consumed:
            if not self.ll.is_error():
                self.ll.consume_tokens(list(tokens[self.consumed:]))
            self.consumed = len(tokens)

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (the request stops here, EOS or not)."""
        return self.ll.is_stopped() and not self.ll.is_error()

    @property
    def error(self) -> str | None:
        return (self.ll.get_error() or "the grammar refused a token") if self.ll.is_error() else None


class MaskJob:
    """Token bitmasks being filled on the compiler's worker thread (`GrammarCompiler.masks`).

    rows: the batch rows they belong to; width: positions per row. `wait` blocks until they are
    filled and returns them as a `GrammarMask` on the logits' device.
    """

    def __init__(self, future: Future, rows: list[int], n: int, width: int):
        self._future, self.rows, self.n, self.width = future, rows, n, width

    def wait(self, device: torch.device | str) -> GrammarMask:
        host = self._future.result()
        words = host.shape[-1]
        bitmask = host.view(self.n, self.width, words) if self.width > 1 else host
        device = torch.device(device)
        # Pinned host memory copies asynchronously; the sampler's kernels are queued after it.
        return GrammarMask(tensor_on(self.rows, torch.int64, device),
                           bitmask.to(device, non_blocking=host.is_pinned()))
