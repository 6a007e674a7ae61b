"""The KV link's NIXL settings for GPU caches (`workers.kv_link.gpu_push_tuning`) and
the serve config field that picks them (`transfer.push_threads`)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from workers.kv_link import DEFAULT_PUSH_THREADS, gpu_push_tuning


def test_push_threads_map_to_nixl_settings():
    assert gpu_push_tuning() == gpu_push_tuning(DEFAULT_PUSH_THREADS)
    four = gpu_push_tuning(4)
    # one UCX worker (one CUDA stream) per posting thread; scatter-gather off
    assert four["backend_params"] == {"num_threads": "4", "num_workers": "4", "split_batch_size": "8"}
    assert four["ucx_sgl"] is False
    assert gpu_push_tuning(0) == {"ucx_sgl": True}  # the previous setting: one thread, scatter-gather offload
    with pytest.raises(ValueError, match="push threads must be >= 0"):
        gpu_push_tuning(-1)


def test_transfer_push_threads_config():
    from deployments.app_config import TransferConfig

    assert TransferConfig().push_threads is None  # the link's default
    assert TransferConfig(push_threads=2).push_threads == 2
    with pytest.raises(ValidationError, match="push_threads"):
        TransferConfig(push_threads=-1)
