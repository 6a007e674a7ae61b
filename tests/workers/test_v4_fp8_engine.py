"""DeepSeek-V4 with fp8 caches (``kv_cache_dtype: fp8``): sliding-window keys and compressed entries in
the 584-byte V4 token format (``attention.v4_format``; the tiny model's 32-wide keys: 16 fp8 + 16 bf16
rope + 1 scale padded to 8 = 56 bytes), quantized on write, dequantized on read; indexer keys as fp8 with a
float32 power-of-two scale (``attention.v4_index_format``; 24 + 4 = 28 bytes) and compressor state fp32
(``models.v4.cache_spec``).

The reference is the standalone ``models.v4`` model rounding each key, entry and indexer key through the same
formats when it makes it (``set_kv_cache_format``), whole prompt in one forward: the engine (chunks of 16, batched,
pages) must equal it token for token, monolithic and PD. Not transformers: it has no fp8 cache, and on
this tiny random model any rounding of the keys changes the greedy output (bf16 rounding of the keys alone
moves the teacher-forced logits by up to 4 of a 10 range), so a tolerance against the ``auto`` run would
test nothing; that fp8 rounding is really applied is checked by the output differing from ``auto``'s.
"""

from __future__ import annotations

import pytest
import torch

from attention.group_cache import UNIT_BYTES, GroupLayout
from attention.v4_format import V4CacheFormat, quantize_v4
from attention.v4_index_format import V4IndexFormat
from models.batch import ForwardMode
from models.registry import load_any_model
from models.v4.cache_spec import v4_formats, v4_kv_format
from tests.workers.pd_aborts import abort_at_every_phase
from tests.workers.prompts import random_prompt
from tests.workers.v4_reference import standalone_greedy
from workers.model_runner import WorkItem
from workers.offline import LLM
from workers.page_tables import PageTable

LENGTHS = (1, 9, 40, 261)  # 261: past one 256-token page, mid compressed block of every ratio
NEW = 8

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_fp8(tiny_v4):
    model = load_any_model(tiny_v4, dtype=torch.float32)
    model.set_kv_cache_format(*v4_formats(model.cfg, "fp8"))
    return model


@pytest.fixture(scope="module")
def reference(model_fp8):
    prompts = [random_prompt(n, 300, n) for n in LENGTHS]
    return prompts, standalone_greedy(model_fp8, prompts, NEW)


def test_fp8_engine_equals_the_model_rounding_keys_the_same_way(tiny_v4, model_fp8, reference):
    prompts, want = reference
    llm = LLM(tiny_v4, num_pages=8, chunk_size=16, kv_cache_dtype="fp8")
    assert llm.generate(prompts, max_new_tokens=NEW, ignore_eos=True) == want
    assert llm.generate(prompts[2:3], max_new_tokens=NEW, ignore_eos=True) == want[2:3]  # batch-invariant
    st = llm.stats()
    assert st["pool_free_pages"] == st["pool_total_pages"]
    # Teacher-forced prompt logits through the pages: the standalone model's, bit for bit.
    with torch.inference_mode():
        p = prompts[3]
        ref = model_fp8.logits(model_fp8(torch.tensor(p), [len(p)], [model_fp8.new_state()]))
    assert torch.equal(llm.prompt_logits(p), ref)
    # The rounding is real: the unquantized engine answers differently on these prompts.
    auto = LLM(tiny_v4, num_pages=8, chunk_size=16, kv_cache_dtype="auto")
    assert auto.generate(prompts, max_new_tokens=NEW, ignore_eos=True) != want


def test_fp8_pages_hold_the_format_bytes(tiny_v4, model_fp8):
    """Each group's page geometry is the format's; the bytes at a key's slot are the quantizer's bytes of
    the key the model made, parts then scale rows, at the offsets the format defines (computed here by
    hand, not by the cache's helper); padding stays zero."""
    llm = LLM(tiny_v4, num_pages=4, kv_cache_dtype="fp8")
    cache, cfg = llm.pool.cache, model_fp8.cfg
    fmt = V4CacheFormat.for_head(cfg.head_dim, cfg.qk_rope_head_dim)
    assert (fmt.part_bytes, fmt.scale_bytes, fmt.bytes_per_token) == (48, 8, 56)
    ifmt = V4IndexFormat(cfg.index_head_dim)
    assert (cfg.index_head_dim, ifmt.bytes_per_token, ifmt.page_bytes) == (24, 28, 256 * 28)
    for lay in cache.layouts.values():
        g = lay.group
        if g.kind in ("swa", "compressed"):
            assert lay.fmt == fmt and (g.bytes_per_token, g.page_bytes) == (56, fmt.page_bytes) == (56, 14_352)
            assert cache.view(g.name).shape == (4, len(g.layers), fmt.page_bytes)
        elif g.kind == "indexer":
            assert lay.fmt == ifmt and (g.bytes_per_token, g.page_bytes) == (28, 7_168)
            assert cache.view(g.name).shape == (4, len(g.layers), ifmt.page_bytes)
        else:  # state fp32
            assert lay.fmt is None and lay.dtype == torch.float32
        # Storage = the declared bytes per layer; the transfer moves each group page as its whole units.
        assert lay.page_bytes == len(g.layers) * g.page_bytes
        units = -(-lay.page_bytes // UNIT_BYTES)
        while lay.fmt == fmt and units * UNIT_BYTES % fmt.part_bytes:  # V4 tokens: pages whole token parts apart
            units += 1  # (FlashMLA's V4 decode asserts its page stride is a multiple of the part)
        assert len(cache.units(g.name, [1])) == lay.units_per_page == units
    assert cache.buffer.numel() == sum(4 * lay.units_per_page * UNIT_BYTES for lay in cache.layouts.values())
    assert cache.regions()[0].bytes_per_page == UNIT_BYTES and cache.regions()[0].num_pages == cache.num_units

    p = random_prompt(261, 300, 5)
    table = PageTable({g: [] for g in llm.pool.groups})
    assert llm.pool.grow(table, len(p))
    pages = table.frozen()
    # Two forwards: the second reads the first's keys back from the pages.
    llm.runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(p[:200]), 0, pages)])
    llm.runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(p[200:]), 200, pages)])
    # The standalone model in the same two forwards: a forward's values at a position may differ by a float32
    # ulp with the forward's length (the MoE's and attention's matmul shapes), which a key's bf16 rope part
    # can show.
    st = model_fp8.new_state()
    with torch.inference_mode():
        model_fp8(torch.tensor(p[:200]), [200], [st])
        model_fp8(torch.tensor(p[200:]), [len(p) - 200], [st])
    n = len(p)

    def check(group: str, layer: int, first: int, values: torch.Tensor) -> None:
        parts, scales = quantize_v4(values, fmt)
        slot = cache.layer_slot[group][layer]
        for i in range(values.shape[0]):
            page, off = divmod(first + i, 256)
            row = cache.view(group)[pages[group][page], slot]
            assert torch.equal(row[off * 48:(off + 1) * 48], parts[i]), (group, layer, first + i)
            at = 256 * 48 + off * 8
            assert torch.equal(row[at:at + 8], scales[i]), (group, layer, first + i)

    for layer in range(cfg.num_hidden_layers):
        swa = st.layers[layer].swa  # every key of the one forward: positions [0, n)
        check("swa", layer, n - swa.shape[0], swa)
    check("csa_kv", 1, 0, st.layers[1].comp.entries)
    check("hca_kv", 2, 0, st.layers[2].comp.entries)
    # Indexer keys: 24 fp8 bytes each, then the page's 256 float32 scales, powers of two.
    keys = st.layers[1].index.entries
    assert keys.shape[0] == n // 4
    amax = keys.float().abs().amax(dim=-1).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    q = (keys.float() / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    slot = cache.layer_slot["csa_index"][1]
    for i in range(keys.shape[0]):
        page, off = divmod(i, 256)
        row = cache.view("csa_index")[pages["csa_index"][page], slot]
        assert torch.equal(row[off * 24:(off + 1) * 24], q[i]), i
        assert row[256 * 24 + off * 4:256 * 24 + (off + 1) * 4].view(torch.float32).item() == scale[i].item(), i
    # The model's keys are already rounded: they are what the page decodes to.
    assert torch.equal(keys.float(), q.view(torch.float8_e4m3fn).float() * scale[:, None])
    assert st.layers[2].comp.entries.shape[0] == n // 8
    for g in ("swa", "csa_kv", "hca_kv"):  # the page's padding past the scale rows
        assert (cache.view(g)[:, :, 256 * 56:] == 0).all()
    llm.pool.free(table)


def test_fp8_pd_equals_monolithic_and_aborts_leave_every_pool_whole(tiny_v4, reference):
    prompts, want = reference
    llm = LLM(tiny_v4, num_pages=8, chunk_size=16, pd=True, kv_cache_dtype="fp8")
    assert llm.generate(prompts, max_new_tokens=NEW, ignore_eos=True) == want
    st = llm.stats()
    assert st["pool_free_pages"] == st["pool_total_pages"] == st["prefill_pool_free_pages"]
    assert llm.pd.prefill.pool.cache.formats() == llm.pd.decode.pool.cache.formats()
    assert "v4fp8[16+16]x56" in dict(llm.pd.decode.pool.cache.formats())["swa"]
    abort_at_every_phase(llm.pd.prefill, llm.pd.decode)
    for pools in (llm.pd.prefill.pool, llm.pd.decode.pool):
        assert pools.free_counts() == {g: p.num_pages for g, p in pools.pools.items()}


def test_group_layout_refuses_a_geometry_it_does_not_store(tiny_v4, model_fp8):
    from models.v4.cache_spec import v4_cache_groups

    cfg = model_fp8.cfg
    fmt = v4_kv_format(cfg, "fp8")
    auto = {g.name: g for g in v4_cache_groups(cfg, "auto", torch.float32)}
    fp8 = {g.name: g for g in v4_cache_groups(cfg, "fp8", torch.float32)}
    assert (auto["swa"].bytes_per_token, fp8["swa"].bytes_per_token) == (4 * 32, 56)
    assert (auto["csa_index"].bytes_per_token, fp8["csa_index"].bytes_per_token) == (4 * 24, 28)
    assert auto["csa_state"] == fp8["csa_state"]
    with pytest.raises(ValueError, match="declares 56 bytes"):
        GroupLayout(fp8["swa"], torch.float32, 32)
    with pytest.raises(ValueError, match="declares 128 bytes"):
        GroupLayout(auto["swa"], torch.uint8, 32, fmt)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        v4_kv_format(cfg, "int8")
