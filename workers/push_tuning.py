"""How a KV link pushes: NIXL posting threads, descriptor size (``transfer`` in a serve config),
and, for a link that pushes, no NIXL progress thread. Plain values, no torch: the serve config
reads its defaults from here."""

from __future__ import annotations

from dataclasses import dataclass, replace

# NIXL / UCX settings of an agent whose cache is in GPU memory. UCX's
# cuda_ipc issues every copy to one peer GPU from one UCX worker on one CUDA
# stream; splitting each WRITE over N posting threads on N UCX workers gives it
# N streams. CPU (DRAM) agents keep NIXL's defaults (UCX only emulates
# scatter-gather there). Why 8: docs/perf.md, "Tuning choices and their measurements".
DEFAULT_PUSH_THREADS = 8

# A cross_layer cache pushes a request's run of pages as one descriptor (None:
# runs are not cut). A WRITE of one descriptor (a request on contiguous pages)
# is posted on the calling thread, one copy with no thread to wake; a
# fragmented one (many runs) is spread over the threads. Measured against
# 16-page descriptors: docs/perf.md, "Tuning choices and their measurements".
DEFAULT_DESCRIPTOR_PAGES: int | None = None


def gpu_push_tuning(threads: int | None = None, pushes: bool = False) -> dict:
    """`TransferAgent` keyword arguments for a GPU cache: ``threads`` posting
    threads on as many UCX workers (None: `DEFAULT_PUSH_THREADS`), which take a
    WRITE of two or more descriptors; one of a single descriptor is posted on
    the calling thread. 0: one thread with UCX scatter-gather offload.

    ``pushes``: the agent posts WRITEs (a prefill replica's). It then runs
    without NIXL's progress thread: that thread spins over the calling
    thread's UCX worker under its lock, and a WRITE posted there waited for it
    (docs/perf.md, "Tuning choices and their measurements"). The pusher's own polls progress the worker
    (each prefill round; a finished prompt's push is spun on). A receiving
    agent keeps the thread: decode must take notifications while it computes.
    """
    threads = DEFAULT_PUSH_THREADS if threads is None else int(threads)
    if threads < 0:
        raise ValueError(f"push threads must be >= 0, got {threads}")
    progress = {"progress_thread": False} if pushes else {}
    if threads == 0:
        return {"ucx_sgl": True, **progress}
    # NIXL's split_batch_size is also the fewest descriptors per thread: 2 still spreads a
    # fragmented 8k request (~30 runs) over all 8 threads; 8 gave it 4 (docs/perf.md).
    return {"ucx_sgl": False, **progress,
            "backend_params": {"num_threads": str(threads), "num_workers": str(threads),
                               "split_batch_size": "2"}}


@dataclass(frozen=True)
class PushTuning:
    """How a KV link pushes (``transfer`` in a serve config).

    ``threads``: NIXL posting threads of a GPU agent (`gpu_push_tuning`; None:
    `DEFAULT_PUSH_THREADS`). ``descriptor_pages``: most pages per descriptor
    (`transfer.Pusher`'s ``run_pages``; None: whole runs). ``pushes``: the
    link's agent posts WRITEs (a prefill replica's link; `gpu_push_tuning`).
    """

    threads: int | None = None
    descriptor_pages: int | None = DEFAULT_DESCRIPTOR_PAGES
    pushes: bool = False

    def __post_init__(self) -> None:
        if self.descriptor_pages is not None and self.descriptor_pages < 1:
            raise ValueError(f"descriptor_pages must be >= 1 or None, got {self.descriptor_pages!r}")

    def for_prefill(self) -> "PushTuning":
        """The same settings for a link that pushes."""
        return replace(self, pushes=True)
