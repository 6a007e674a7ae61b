"""Loss curves of a training log (``log.json`` of `models.train.train`) as a PNG, or SVG without matplotlib.

    python -m models.train.plot RUN/log.json docs/img/small-v32-loss.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["curves", "plot_log"]

_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")


def curves(log: dict) -> dict[str, list[tuple[float, float]]]:
    """name -> [(tokens seen in millions, value)] of every curve the plot draws."""
    out: dict[str, list[tuple[float, float]]] = {"train LM": [], "train MTP": [], "indexer KL": [],
                                                  "held-out LM": [], "held-out MTP": []}
    for e in log["train"]:
        x = e["tokens"] / 1e6
        if e.get("lm_loss") is not None:
            out["train LM"].append((x, e["lm_loss"]))
        if e.get("mtp_loss") is not None:
            out["train MTP"].append((x, e["mtp_loss"]))
        out["indexer KL"].append((x, e["indexer_kl"]))
    for e in log["eval"]:
        x = e["tokens"] / 1e6
        out["held-out LM"].append((x, e["lm_loss"]))
        if e.get("mtp_loss") is not None:
            out["held-out MTP"].append((x, e["mtp_loss"]))
    return {k: v for k, v in out.items() if v}


def _phase_starts(log: dict) -> list[tuple[float, str]]:
    starts, last, prev = [], None, 0.0
    for e in log["train"]:
        if e["phase"] != last:
            # A stage starts where the previous logged point ends (the first at 0).
            starts.append((prev, e["phase"]))
            last = e["phase"]
        prev = e["tokens"] / 1e6
    return starts


def plot_log(log: dict, path: str | Path, title: str = "") -> Path:
    """Write the curves to ``path``: PNG through matplotlib when it is installed, else an SVG
    written by hand (``path`` then gets the ``.svg`` suffix). Returns the path written."""
    path = Path(path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _svg(log, path.with_suffix(".svg"), title)
    fig, (ax, axk) = plt.subplots(1, 2, figsize=(11, 4))
    for (name, pts), c in zip(curves(log).items(), _COLORS):
        target = axk if name == "indexer KL" else ax
        target.plot([p[0] for p in pts], [p[1] for p in pts], label=name, color=c,
                    marker="o" if name.startswith("held-out") else None, markersize=3)
    for a in (ax, axk):
        for x, phase in _phase_starts(log):
            a.axvline(x, color="grey", lw=0.6, ls="--")
            a.text(x, 1.0, f" {phase}", transform=a.get_xaxis_transform(), fontsize=7, va="top")
        a.set_xlabel("training tokens (millions)")
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    ax.set_ylabel("cross-entropy (nats)")
    axk.set_ylabel("KL(attention || indexer), nats")
    axk.set_yscale("log")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _svg(log: dict, path: Path, title: str) -> Path:
    """One panel, losses only, axes from the data (no dependency)."""
    cs = {k: v for k, v in curves(log).items() if k != "indexer KL"}
    pts = [p for v in cs.values() for p in v]
    W, H, m = 720, 400, 50
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts) or 1.0
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    sx = lambda x: m + (x - x0) / ((x1 - x0) or 1) * (W - 2 * m)  # noqa: E731
    sy = lambda y: H - m - (y - y0) / ((y1 - y0) or 1) * (H - 2 * m)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
             f'<rect width="{W}" height="{H}" fill="white"/>',
             f'<text x="{W / 2}" y="20" text-anchor="middle">{title}</text>',
             f'<line x1="{m}" y1="{H - m}" x2="{W - m}" y2="{H - m}" stroke="black"/>',
             f'<line x1="{m}" y1="{m}" x2="{m}" y2="{H - m}" stroke="black"/>',
             f'<text x="{W / 2}" y="{H - 10}" text-anchor="middle">training tokens (millions): {x0:.1f} .. {x1:.1f}</text>',
             f'<text x="12" y="{H / 2}" transform="rotate(-90 12 {H / 2})" text-anchor="middle">'
             f'cross-entropy {y0:.2f} .. {y1:.2f}</text>']
    for i, ((name, v), c) in enumerate(zip(cs.items(), _COLORS)):
        d = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in v)
        parts.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{d}"/>')
        parts.append(f'<text x="{W - m - 120}" y="{m + 14 * i}" fill="{c}">{name}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="plot a training log.json")
    ap.add_argument("log")
    ap.add_argument("out")
    ap.add_argument("--title", default="")
    a = ap.parse_args(argv)
    print(plot_log(json.loads(Path(a.log).read_text()), a.out, a.title))


if __name__ == "__main__":
    main()
