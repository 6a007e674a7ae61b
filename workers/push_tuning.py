"""How a KV link pushes: NIXL posting threads and descriptor size (``transfer`` in a serve
config). Plain values, no torch: the serve config reads its defaults from here."""

from __future__ import annotations

from dataclasses import dataclass

# NIXL / UCX settings of an agent whose cache is in GPU memory. UCX's
# cuda_ipc issues every copy to one peer GPU from one UCX worker on one CUDA
# stream; splitting each WRITE over N posting threads on N UCX workers gives it
# N streams. Streams of 32k-token DeepSeek-V3.2 requests, 8 in flight
# (docs/perf.md, session 4), 8 threads: one H100 0.997-0.999 of a device copy
# (one thread with scatter-gather offload, the previous setting: 0.55); 2 x H200
# 0.94-0.96 of a peer copy (previous setting: 0.62). 16 threads measured worse
# on the H100 (0.58), 2 and 4 slower for single requests. CPU (DRAM) agents
# keep NIXL's defaults (UCX only emulates scatter-gather there).
DEFAULT_PUSH_THREADS = 8

# A cross_layer cache pushes a request's run of pages as one descriptor unless
# it is cut: 16-page descriptors (49 MB of DeepSeek-V3.2 pages) spread an 8k
# request over 8 posting threads, and NIXL splits a WRITE of as few as one
# descriptor (split_batch_size 1). With that, 2 x H200: 8k requests 0.89-0.91 of
# a peer copy alone and 0.98-1.02 streamed (0.80 / 0.86 on the per_layer cache);
# one H100: 0.69 / 0.77-0.99 (per_layer 0.64-0.69 / 0.71-0.78). docs/perf.md, session 5.
DEFAULT_DESCRIPTOR_PAGES = 16


def gpu_push_tuning(threads: int | None = None) -> dict:
    """`TransferAgent` keyword arguments for a GPU cache: ``threads`` posting
    threads on as many UCX workers (None: `DEFAULT_PUSH_THREADS`); 0: one
    thread with UCX scatter-gather offload."""
    threads = DEFAULT_PUSH_THREADS if threads is None else int(threads)
    if threads < 0:
        raise ValueError(f"push threads must be >= 0, got {threads}")
    if threads == 0:
        return {"ucx_sgl": True}
    # split_batch_size 1: a WRITE of any number of descriptors is spread over the threads
    # (NIXL's default, 1024, would post a cross_layer request's few descriptors from one).
    return {"ucx_sgl": False,
            "backend_params": {"num_threads": str(threads), "num_workers": str(threads), "split_batch_size": "1"}}


@dataclass(frozen=True)
class PushTuning:
    """How a KV link pushes (``transfer`` in a serve config).

    ``threads``: NIXL posting threads of a GPU agent (`gpu_push_tuning`; None:
    `DEFAULT_PUSH_THREADS`). ``descriptor_pages``: most pages per descriptor
    (`transfer.Pusher`'s ``run_pages``; None: whole runs).
    """

    threads: int | None = None
    descriptor_pages: int | None = DEFAULT_DESCRIPTOR_PAGES

    def __post_init__(self) -> None:
        if self.descriptor_pages is not None and self.descriptor_pages < 1:
            raise ValueError(f"descriptor_pages must be >= 1 or None, got {self.descriptor_pages!r}")
