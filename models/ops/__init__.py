"""Model compute ops with two implementations behind one signature:
``*_ref`` (plain torch, runs anywhere: the spec the tests use) and ``*_cuda``
(Triton kernels on a CUDA device), tested against each other."""

import functools
import importlib.util


@functools.cache
def triton_importable() -> bool:
    """Whether the ``*_cuda`` ops can run here (Triton installed); checked once per process."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def cuda_ops(name: str):
    """The ``models.ops.<name>`` Triton module where Triton is installed, else None (imported once): what a
    torch module calls on CUDA tensors instead of its torch spec."""
    if not triton_importable():
        return None
    return importlib.import_module(f"models.ops.{name}")
