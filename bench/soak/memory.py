"""Resident memory of a server's processes over a soak, and whether it stayed flat.

The processes are the ones the server's ``GET /stats`` names (every prefill
and decode replica's ``pid``, and the ingress replica that answered), read
from ``/proc/<pid>/status`` (``VmRSS``): the soak must run on the server's
host (a local ``serve run``; on Kubernetes, run it inside the head pod). A
replica that Serve replaced shows up as a new process with its own series.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path


def rss_mib(pid: int) -> float | None:
    """``VmRSS`` of ``pid`` in MiB; None when the process is gone or not on this host."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        return None
    return None


def processes(stats: dict) -> dict[str, int]:
    """``{name: pid}`` of the processes a ``/stats`` answer names: ``prefill-<agent>``,
    ``decode-<agent>``, their engine processes (``engine_process``) as ``...-engine``, ``ingress``."""
    out = {}
    for role in ("prefill", "decode"):
        for e in stats.get(role, []):
            if e.get("pid"):
                out[f"{role}-{e['agent']}"] = int(e["pid"])
            if e.get("engine_pid"):
                out[f"{role}-{e['agent']}-engine"] = int(e["engine_pid"])
    ingress = stats.get("ingress") or {}
    if ingress.get("pid"):
        out["ingress"] = int(ingress["pid"])
    return out


@dataclass
class MemorySeries:
    """``samples[name]``: ``(seconds since the soak began, RSS MiB)`` of one process."""

    start: float = field(default_factory=time.monotonic)
    samples: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def sample(self, stats: dict) -> None:
        t = round(time.monotonic() - self.start, 1)
        for name, pid in processes(stats).items():
            rss = rss_mib(pid)
            if rss is not None:
                self.samples.setdefault(f"{name} (pid {pid})", []).append((t, round(rss, 1)))

    def growth(self, warmup_s: float) -> dict[str, dict[str, float]]:
        """Per process seen before and after ``warmup_s``: the median RSS of the first and of the last
        quarter of its samples after the warm-up, and the difference (MiB, and percent)."""
        out = {}
        for name, series in self.samples.items():
            after = [rss for t, rss in series if t >= warmup_s]
            if len(after) < 8:
                continue
            q = len(after) // 4
            first, last = _median(after[:q]), _median(after[-q:])
            out[name] = {"first_quarter_mib": first, "last_quarter_mib": last, "growth_mib": round(last - first, 1),
                         "growth_pct": round(100.0 * (last - first) / first, 1)}
        return out


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]
