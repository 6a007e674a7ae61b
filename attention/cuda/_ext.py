"""Lazy access to the compiled kernel packages of the ``cuda`` backend.

``deep_gemm`` (sgl-deep-gemm 0.1.4) and ``flash_mla`` (sgl-flash-mla 1.0.0)
are imported on first use, never at module import, so that the host-side
helpers of :mod:`attention.cuda` (context lengths, chunk plans) import and
test on a CPU-only machine. A missing package is reported once, naming it.
"""

from __future__ import annotations

import importlib
import threading
from functools import lru_cache

PACKAGES = {
    "deep_gemm": "sgl-deep-gemm==0.1.4 (+ apache-tvm-ffi==0.1.11); >= 0.1.5 is built for a newer torch",
    "flash_mla": "sgl-flash-mla==1.0.0",
}


class KernelPackageMissing(ImportError):
    """A kernel package of the cuda backend cannot be imported here."""


def _import(name: str):
    try:
        return importlib.import_module(name)
    except Exception as exc:  # ImportError, or OSError from a .so that finds no CUDA driver
        raise KernelPackageMissing(
            f"the cuda attention backend needs {name} ({PACKAGES[name]}) on a CUDA GPU; "
            f"importing it failed: {type(exc).__name__}: {exc}"
        ) from exc


_DEEP_GEMM_LOCK = threading.RLock()


class _OneCallerAtATime:
    """``deep_gemm`` with every call made under one process-wide lock.

    DeepGEMM compiles a kernel on its first call with a new configuration, and its JIT is not
    thread-safe: two threads meeting the same new shape at once failed on an H200 with
    "Circular include may occur" (session 15: two-batch overlap's micro-batch threads, since refused
    on the cuda backend; any other caller on a second thread would meet the same). Its calls only
    launch (asynchronous), so the lock is held for microseconds once the kernels exist."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name: str):
        attr = getattr(self._module, name)
        if not callable(attr):
            return attr

        def locked(*args, **kwargs):
            with _DEEP_GEMM_LOCK:
                return attr(*args, **kwargs)
        return locked


def deep_gemm():
    return _OneCallerAtATime(_import("deep_gemm"))


def flash_mla():
    return _import("flash_mla")


@lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors DeepGEMM schedules over (its own setting, default: all)."""
    dg = deep_gemm()
    getter = getattr(dg, "get_num_sms", None)
    if getter is not None:
        return int(getter())
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


def clear_caches() -> None:
    """Forget cached device properties (tests that swap kernel modules call this)."""
    num_sms.cache_clear()
