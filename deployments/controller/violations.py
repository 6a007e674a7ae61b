"""A violation of the controller's rules: the field to change and why (`Violation`), the error that
lists them (`AppConfigError`), and pydantic's field errors as violations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pydantic


@dataclass(frozen=True)
class Violation:
    """One broken rule: ``path`` is the field to change (dotted, relative to the app args)."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class AppConfigError(ValueError):
    """An application config that cannot be deployed; ``violations`` lists every reason."""

    def __init__(self, violations: list[Violation]):
        self.violations = tuple(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"{len(self.violations)} configuration violation(s):\n{lines}")


def _loc_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def violations_from_pydantic(err: pydantic.ValidationError, prefix: str = "") -> list[Violation]:
    """Every error of a pydantic validation as a ``Violation`` (path from its location)."""
    out = []
    for e in err.errors(include_url=False):
        path = _loc_path(tuple(e["loc"]))
        if prefix:
            path = f"{prefix}.{path}" if path else prefix
        msg = e["msg"]
        if e["type"] == "value_error":
            # Our own validators' messages; pydantic prefixes them with "Value error, ".
            msg = str(e.get("ctx", {}).get("error", msg.removeprefix("Value error, ")))
        elif e["type"] == "extra_forbidden":
            msg = "unknown field (a typo?)"
        elif e["type"] == "missing":
            msg = "required field missing"
        else:
            msg = f"{msg} (got {e.get('input')!r})"
        out.append(Violation(path or "(root)", msg))
    return out
