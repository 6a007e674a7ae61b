"""Token ids -> the text a client sees, incrementally, with OpenAI's stop-string rule.

The decode engine stops a request as soon as a stop string appears in its
detokenized output; OpenAI returns the text *before* the stop string. While
streaming, text that could still turn out to be the start of a stop string,
or that ends in an incomplete UTF-8 sequence (byte-level tokenizers decode
a partial character as U+FFFD until its last byte arrives), is held back
until the next tokens decide it. The concatenation of the pieces equals the
non-streamed text.
"""

from __future__ import annotations

from typing import Sequence

_REPLACEMENT = "\ufffd"


def truncate_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` cut before the earliest stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


class TextStream:
    """Accumulates token ids of one request; `push` returns the new text that is safe to send."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; the text now known for good (may be empty)."""
        self.ids.extend(token_ids)
        if self.stopped:
            return ""
        text = self._text()
        text, self.stopped = truncate_at_stop(text, self.stop)
        if not self.stopped:
            text = text.rstrip(_REPLACEMENT)
            # Hold back the longest tail that is a proper prefix of some stop string.
            hold = max((k for s in self.stop for k in range(1, min(len(s), len(text) + 1))
                        if text.endswith(s[:k])), default=0)
            text = text[:len(text) - hold]
        return self._advance(text)

    def finish(self) -> str:
        """The request ended: everything not sent yet (stop string excluded)."""
        text, self.stopped = truncate_at_stop(self._text(), self.stop)
        return self._advance(text)

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent):
            # Only a decoder that rewrites earlier text gets here; never resend.
            return ""
        delta = text[len(self.sent):]
        self.sent = text
        return delta

    @property
    def text(self) -> str:
        """The full text so far (what a non-streamed response carries once finished)."""
        return truncate_at_stop(self._text(), self.stop)[0]
