"""How long a loop that waits without the GIL takes to get it back beside busy Python threads.

A model of a replica's engine thread: each step runs a little Python and three GIL-free waits (as
device calls and copies release the GIL), while other threads of the interpreter run Python (Serve's
event loops streaming outputs). Every wait ends with the GIL held by someone else, released at the
holder's next I/O or at the switch interval. Prints the step time per switch interval. A CPU diagnostic
for `prefill/decode.gil_switch_interval_ms` (docs/perf.md, session 21), not a measure of the engine.

    python3 -m bench.gil_handover [--busy-threads 2] [--intervals-ms 5 1 0.5 0.2]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time


def _busy(stop: threading.Event, work: int) -> None:
    x = 0
    while not stop.is_set():
        for i in range(work):  # Python that holds the GIL (a burst of event-loop callbacks)
            x += i * i
        time.sleep(0.0003)     # then a short I/O wait


def _engine(steps: int, wait_s: float) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        s = 0
        for i in range(3000):  # the step's own host work, ~0.1 ms
            s += i
        for _ in range(3):     # device waits: the GIL is released
            time.sleep(wait_s)
    return (time.perf_counter() - t0) / steps * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy-threads", type=int, default=2)
    ap.add_argument("--busy-work", type=int, default=60000, help="loop iterations per burst of a busy thread")
    ap.add_argument("--intervals-ms", type=float, nargs="+", default=[5, 1, 0.5, 0.2])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args(argv)
    before = sys.getswitchinterval()
    print(f"alone: {_engine(args.steps, 0.001):.2f} ms a step")
    try:
        for iv in args.intervals_ms:
            sys.setswitchinterval(iv / 1e3)
            stop = threading.Event()
            threads = [threading.Thread(target=_busy, args=(stop, args.busy_work)) for _ in range(args.busy_threads)]
            for t in threads:
                t.start()
            ms = _engine(args.steps, 0.001)
            stop.set()
            for t in threads:
                t.join()
            print(f"switch interval {iv:g} ms, {args.busy_threads} busy threads: {ms:.2f} ms a step")
    finally:
        sys.setswitchinterval(before)


if __name__ == "__main__":
    main()
