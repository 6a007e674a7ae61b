"""Backend registry."""

from __future__ import annotations

import pytest

from attention import formats, indexer, sparse_mla
from attention.backend import AttentionBackend, BackendUnavailableError, get_backend


def test_reference_backend_exposes_the_interface():
    be = get_backend("reference")
    assert isinstance(be, AttentionBackend) and be.name == "reference"
    assert be.paged_mqa_logits is indexer.paged_mqa_logits
    assert be.ragged_mqa_logits is indexer.ragged_mqa_logits
    assert be.topk_slots is indexer.topk_slots
    assert be.sparse_mla_decode is sparse_mla.sparse_mla_decode
    assert be.sparse_mla_prefill is sparse_mla.sparse_mla_prefill
    assert be.quantize_mla_fp8 is formats.quantize_mla_fp8
    assert be.dequantize_indexer_fp8 is formats.dequantize_indexer_fp8
    assert get_backend("reference") is be


def test_cuda_backend_not_built_yet():
    with pytest.raises(NotImplementedError, match="flash_mla.*deep_gemm") as info:
        get_backend("cuda")
    assert isinstance(info.value, BackendUnavailableError)


@pytest.mark.parametrize("name", ["", "Reference", "triton", None])
def test_unknown_backend(name):
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend(name)
