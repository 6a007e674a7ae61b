"""The memory series of a soak's result as a PNG: ``python -m bench.soak.plot RESULT.json OUT.png``
(matplotlib, the ``docs`` extra). One line per process `GET /stats` named; the warm-up shaded."""

from __future__ import annotations

import json
import sys


def plot(result: dict, out: str, warmup_s: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, series in sorted(result["memory_series"].items()):
        ax.plot([t / 60 for t, _ in series], [rss for _, rss in series], label=name, linewidth=1.2)
    warmup_s = result.get("warmup_s") if warmup_s is None else warmup_s
    if warmup_s:
        ax.axvspan(0, warmup_s / 60, color="0.9", label="warm-up")
    ax.set_xlabel("minutes since the soak began")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"dsa-pd bench soak: {result['clients']} clients, {result['duration_s'] / 60:.0f} min, "
                 f"{result['unexpected']} unexpected, {result['leaked_pages']} pages leaked", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        print("usage: python -m bench.soak.plot RESULT.json OUT.png [WARMUP_S]", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        result = json.load(f)
    plot(result, args[1], float(args[2]) if len(args) == 3 else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
