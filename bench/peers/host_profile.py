"""Where a served replica's Python time goes during a run, from `py-spy record --threads -f raw`.

The engine thread shares its replica's interpreter (and GIL) with Serve's and Ray's threads; a
served step slower than the offline one is either the engine's own host work or time it spent
waiting for the GIL while the others ran (docs/perf.md, session 21). py-spy counts a thread's sample
only while it is active, so the active samples per thread, set side by side, say who held the
interpreter. Prints, per thread: active samples and their share of the sampling slots; then the
hottest leaf frames and the repository functions by inclusive samples.

    python -m bench.peers.host_profile RAW.txt [--rate 250] [--seconds 6] [--top 12] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

REPO_DIRS = ("deployments/", "workers/", "models/", "attention/", "transfer/")
THREAD = re.compile(r"^thread \((?:0x)?[0-9a-fA-F]+\)(?::\s*(?P<name>.*))?$")


def read_raw(text: str) -> list[tuple[list[str], int]]:
    """``py-spy -f raw`` lines (``frame;frame;... count``, root first) -> [(frames, samples)]."""
    out = []
    for line in text.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if stack and n.isdigit():
            out.append((stack.split(";"), int(n)))
    return out


def thread_name(root: str) -> str:
    """The thread a stack ran on: py-spy's ``thread (ID): NAME`` root frame (with ``--threads``)."""
    m = THREAD.match(root.strip())
    if m is None:
        return "?"
    name = m.group("name") or "(unnamed)"
    # Name families, so that runs compare: a decode worker thread is named after its replica.
    return re.sub(r"(decode|prefill):\S+", r"\1:<replica>", name)


def summarize(stacks: list[tuple[list[str], int]], top: int = 12) -> dict:
    threads: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    repo: collections.Counter[str] = collections.Counter()
    for frames, n in stacks:
        threads[thread_name(frames[0])] += n
        leaves[frames[-1]] += n
        for fr in {f for f in frames[1:] if any(d in f for d in REPO_DIRS)}:
            repo[re.sub(r":\d+\)$", ")", fr)] += n  # one count per stack and function, not per line
    return {"threads": threads.most_common(), "leaves": leaves.most_common(top), "repository": repo.most_common(top),
            "samples": sum(threads.values())}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", help="py-spy record --threads -f raw output")
    ap.add_argument("--rate", type=float, default=250, help="py-spy's sampling rate (Hz)")
    ap.add_argument("--seconds", type=float, default=6, help="py-spy's duration (s)")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    s = summarize(read_raw(Path(args.raw).read_text()), args.top)
    slots = args.rate * args.seconds
    print(f"{s['samples']} active samples in {slots:.0f} sampling slots per thread")
    for name, n in s["threads"]:
        print(f"  {n:6d}  {100 * n / slots:5.1f}% of the run  {name}")
    print("hottest leaf frames:")
    for fr, n in s["leaves"]:
        print(f"  {n:6d}  {fr[:140]}")
    print("repository functions (inclusive):")
    for fr, n in s["repository"]:
        print(f"  {n:6d}  {fr[:140]}")
    if args.json:
        Path(args.json).write_text(json.dumps({**s, "rate": args.rate, "seconds": args.seconds}, indent=1))


if __name__ == "__main__":
    main()
