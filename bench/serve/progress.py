"""A progress bar on stderr: tqdm when it is installed (it comes with
transformers), else a plain ``done/total`` counter; nothing when disabled."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, desc: str = "requests", disable: bool = False):
        self.total, self.done, self.desc, self.disable = total, 0, desc, disable
        self._bar = None
        self._last = 0.0
        if disable:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, desc=desc, file=sys.stderr)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.disable:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last >= 0.5 or self.done >= self.total:
            self._last = now
            print(f"\r{self.desc}: {self.done}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.disable:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            print(file=sys.stderr, flush=True)
