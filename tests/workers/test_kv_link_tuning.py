"""The KV link's NIXL settings for GPU caches (`workers.push_tuning.gpu_push_tuning`), its
descriptor size, and the serve config fields that pick them (`transfer.push_threads`,
`transfer.descriptor_pages`)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from workers.push_tuning import DEFAULT_DESCRIPTOR_PAGES, DEFAULT_PUSH_THREADS, PushTuning, gpu_push_tuning


def test_push_threads_map_to_nixl_settings():
    assert gpu_push_tuning() == gpu_push_tuning(DEFAULT_PUSH_THREADS)
    four = gpu_push_tuning(4)
    # one UCX worker (one CUDA stream) per posting thread; a WRITE of two or more descriptors is split
    # over them, one of a single descriptor posted on the calling thread; scatter-gather off
    assert four["backend_params"] == {"num_threads": "4", "num_workers": "4", "split_batch_size": "2"}
    assert four["ucx_sgl"] is False and "progress_thread" not in four  # NIXL's default: on
    assert gpu_push_tuning(0) == {"ucx_sgl": True}  # the previous setting: one thread, scatter-gather offload
    # A pushing agent runs without NIXL's progress thread (it would hold the calling thread's worker).
    assert gpu_push_tuning(4, pushes=True) == {**four, "progress_thread": False}
    assert gpu_push_tuning(0, pushes=True) == {"ucx_sgl": True, "progress_thread": False}
    with pytest.raises(ValueError, match="push threads must be >= 0"):
        gpu_push_tuning(-1)


def test_transfer_push_threads_config():
    from deployments.app_config import TransferConfig

    assert TransferConfig().push_threads is None  # the link's default
    assert TransferConfig(push_threads=2).push_threads == 2
    with pytest.raises(ValidationError, match="push_threads"):
        TransferConfig(push_threads=-1)


def test_descriptor_pages_config_reaches_the_link():
    from deployments.app_config import TransferConfig

    assert TransferConfig().descriptor_pages is DEFAULT_DESCRIPTOR_PAGES is None  # whole runs
    assert TransferConfig().push_tuning() == PushTuning(threads=None, descriptor_pages=None, pushes=False)
    assert TransferConfig(push_threads=2, descriptor_pages=16).push_tuning() == PushTuning(2, 16)
    assert PushTuning(2, 16).for_prefill() == PushTuning(2, 16, pushes=True)
    with pytest.raises(ValidationError, match="descriptor_pages"):
        TransferConfig(descriptor_pages=0)
    with pytest.raises(ValueError, match="descriptor_pages"):
        PushTuning(descriptor_pages=0)


def test_link_pusher_cuts_runs_to_descriptor_pages(tmp_path):
    """A real KVLink over a cross_layer cache: its pusher cuts runs to the configured pages."""
    import json

    import torch

    from attention.cache import CacheSpec, PagedKVCache
    from workers.kv_link import KVLink

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v32"}))
    cache = PagedKVCache(CacheSpec(2, 8, 32, 8, 16, "auto", torch.float32))
    link = KVLink.create("kvlink-test", tmp_path, cache, has_mtp=False, push=PushTuning(descriptor_pages=3))
    try:
        assert link.pusher().run_pages == 3 and link.agent.compat.kv_format == "fp32_mla_40+index/cross_layer"
    finally:
        link.close()


def test_only_prefill_replicas_build_a_link_that_pushes(monkeypatch):
    """A prefill replica's link pushes (on a GPU: no NIXL progress thread); a decode replica's does not."""
    from deployments import replica_build
    from deployments.app_config import AppConfig
    from tests.deployments.app_fixtures import yaml_args

    seen = {}

    class Built(Exception):
        pass

    def build_replica(spec, tp_size=1, worker_id=None, actor_options=None, **_):
        seen[worker_id] = spec.push
        raise Built  # the tuning is all this test needs

    monkeypatch.setattr(replica_build, "build_replica", build_replica)
    cfg = AppConfig.model_validate(yaml_args("tiny_pd.yaml"))
    for build, worker_id in ((replica_build.build_prefill_worker, "p"), (replica_build.build_decode_worker, "d")):
        with pytest.raises(Built):
            build(cfg, "unused", worker_id)
    assert seen == {"p": cfg.transfer.push_tuning().for_prefill(), "d": cfg.transfer.push_tuning()}
    assert seen["p"].pushes and not seen["d"].pushes
