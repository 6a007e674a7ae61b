"""The KV link on a CUDA cache (run on the H100): a push waits for the kernels that wrote its pages."""

from __future__ import annotations

import time

import pytest
import torch

from attention.cache import CacheSpec, PagedKVCache
from transfer import Pusher
from workers.kv_link import KVLink
from workers.push_tuning import PushTuning

pytestmark = pytest.mark.gpu


def _push(pusher: Pusher, receiver, rid: str, peer_agent: str, prefill_agent: str, local, remote, write) -> None:
    """``write()`` queues the kernels that fill ``local``; the push is called right after, as
    `workers.prefill_worker` does after a forward."""
    n = len(local) * 64
    receiver.expect(rid, prefill_agent, n, remote, 30.0)
    pusher.begin(rid, peer_agent, n, local, remote, 30.0)
    write()
    pusher.push(rid, n)
    end = time.monotonic() + 30
    done = []
    while len(done) < 2 and time.monotonic() < end:
        done += [r for r in pusher.poll(spin_s=0.001) if r.ok] + [r for r in receiver.poll() if r.ok]
    assert len(done) == 2, f"push {rid} did not complete"


def test_push_waits_for_the_kernels_that_wrote_its_pages(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "kv-link-fence-test"}')
    spec = CacheSpec(num_layers=4, num_pages=64, kv_lora_rank=512, rope_dim=64, index_head_dim=128,
                     kv_cache_dtype="fp8", dtype=torch.bfloat16)
    pre_cache, dec_cache = PagedKVCache(spec, "cuda"), PagedKVCache(spec, "cuda")
    pre = KVLink.create("fence-pre", tmp_path, pre_cache, has_mtp=False, push=PushTuning().for_prefill())
    dec = KVLink.create("fence-dec", tmp_path, dec_cache, has_mtp=False)
    try:
        assert pre.fence is not None
        dec.handshake(pre)
        receiver = dec.receiver(release_pages=lambda pages: None)
        src, dst = pre_cache.storage, dec_cache.storage

        def slow_fill(pages, value):
            def write():
                torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before the write
                # A slice, not a list index: indexing by a host list would copy the index to the
                # device and so wait for the queue, hiding the race.
                src[pages[0]:pages[-1] + 1].fill_(value)
            return write

        local, remote = list(range(0, 8)), list(range(8, 16))
        _push(pre.pusher(), receiver, "fenced", dec.agent.name, pre.agent.name, local, remote, slow_fill(local, 7))
        assert bool((dst[remote] == 7).all()), "decode got pages the GPU had not written yet"
        assert int(dst[16:].count_nonzero()) == 0 and int(dst[:8].count_nonzero()) == 0

        # The control: without the fence the copy reads the pages before the queued kernel writes
        # them (UCX's stream does not wait for torch's), so this test can tell the two apart.
        local, remote = list(range(16, 24)), list(range(24, 32))
        bare = Pusher(pre.agent, pre.peers, run_pages=pre.push.descriptor_pages)
        _push(bare, receiver, "bare", dec.agent.name, pre.agent.name, local, remote, slow_fill(local, 9))
        torch.cuda.synchronize()
        assert bool((src[local] == 9).all()) and not bool((dst[remote] == 9).all())
    finally:
        pre.close()
        dec.close()


def test_the_fence_passes_at_once_on_an_idle_stream_and_holds_on_a_busy_one():
    """An idle stream has written every page: no event to wait for (one recorded now would still be
    ahead of the device). With a kernel queued, the fence holds until it ran."""
    from workers.kv_link import cuda_event_fence

    device = torch.device("cuda", torch.cuda.current_device())
    fence = cuda_event_fence(device)
    for _ in range(20):
        torch.cuda.synchronize(device)
        assert fence()(), "the fence of an idle stream did not pass at once"
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
    busy = fence()
    assert not busy(), "the fence passed while the kernel that writes the pages was still queued"
    torch.cuda.synchronize(device)
    assert busy()
