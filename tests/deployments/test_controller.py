"""Controller rules: each invalid config is rejected with the field path and a precise message;
all violations are reported at once; memory estimates and placement plans."""

from __future__ import annotations

import json

import pytest
import torch

from deployments.app_config import AppConfig
from deployments.controller import (
    AppConfigError,
    GiB,
    Violation,
    bytes_per_page,
    check_args,
    check_or_raise,
    estimate_memory,
    model_param_count,
    plan_placement,
    role_compat_info,
    resolve_model_config,
    validate,
    weight_bytes_per_rank,
)
from models.model import DsaForCausalLM
from workers.scheduler import tokens_to_hold
from tests.deployments.app_fixtures import (
    YAMLS,
    gpu_model,
    merged,
    real_model,
    shipped_model,
    tiny_model,
    tiny_raw,
    yaml_args,
)

CPU = yaml_args("tiny_pd.yaml")
GPU = yaml_args("tiny_pd_gpu.yaml")
MONO = yaml_args("tiny_mono.yaml")
MONO_GPU = yaml_args("tiny_mono_gpu.yaml")
DSV32 = yaml_args("dsv32_pd.yaml")
GLM5 = yaml_args("glm5_pd.yaml")
CPU_TP2 = merged(CPU, prefill={"tensor_parallel_size": 2}, decode={"tensor_parallel_size": 2})


def app(args: dict) -> AppConfig:
    return AppConfig.model_validate(args)


def paths(violations) -> list[str]:
    return [v.path for v in violations]


def only(violations, path: str) -> Violation:
    """The single violation at ``path`` (and fail listing all of them otherwise)."""
    hits = [v for v in violations if v.path == path]
    assert len(hits) == 1, f"expected one violation at {path}, got {[str(v) for v in violations]}"
    return hits[0]


# --------------------------------------------------------------------------- valid configs


@pytest.mark.parametrize("name", YAMLS)
def test_shipped_configs_are_valid(name):
    args, m = yaml_args(name), shipped_model(name)
    assert validate(app(args), m) == []
    check_or_raise(app(args), m)  # no exception


# --------------------------------------------------------------------------- feature rules


@pytest.mark.parametrize("sharing", [
    dict(index_topk_freq=2, index_skip_topk_offset=1),
    dict(index_topk_pattern="FSFF"),
    dict(indexer_types=["full", "full", "shared", "full"]),
])
def test_two_batch_overlap_rejected_with_topk_sharing(sharing):
    m = tiny_model("glm_moe_dsa", **sharing)
    assert m.topk_plan.has_sharing
    v = only(validate(app(merged(CPU_TP2, features={"two_batch_overlap": True})), m), "features.two_batch_overlap")
    assert "incompatible with DSA top-k sharing" in v.message and "set two_batch_overlap to false" in v.message


def test_two_batch_overlap_allowed_without_sharing():
    m = tiny_model("glm_moe_dsa", index_topk_freq=1)
    assert not m.topk_plan.has_sharing
    assert validate(app(merged(CPU_TP2, features={"two_batch_overlap": True})), m) == []


def test_two_batch_overlap_needs_tensor_parallel():
    m = tiny_model("deepseek_v32")
    v = only(validate(app(merged(CPU, features={"two_batch_overlap": True})), m), "features.two_batch_overlap")
    assert "tensor_parallel_size is 1 (prefill 1, decode 1): there is nothing to overlap" in v.message
    # Monolithic: decode alone decides.
    mono = merged(MONO, decode={"tensor_parallel_size": 2}, features={"two_batch_overlap": True})
    assert validate(app(mono), m) == []


def test_glm5_config_rejects_two_batch_overlap():
    m = real_model("glm5_pd.yaml")
    found = [v for v in validate(app(merged(GLM5, features={"two_batch_overlap": True})), m)
             if v.path == "features.two_batch_overlap"]
    assert any("57 of 78 layers" in v.message for v in found), [str(v) for v in found]


def test_mtp_topk_reuse_needs_draft_topk_1():
    args = merged(GPU, features={"mtp_topk_reuse": True, "draft_topk": 2})
    v = only(validate(app(args), gpu_model()), "features.mtp_topk_reuse")
    assert "requires draft top-k == 1 (got 2)" in v.message and "set draft_topk to 1" in v.message
    assert validate(app(merged(GPU, features={"mtp_topk_reuse": False, "draft_topk": 2})), gpu_model()) == []


# --------------------------------------------------------------------------- prefill / decode agreement


def test_kv_cache_format_must_agree():
    vs = validate(app(merged(CPU, decode={"kv_cache_dtype": "auto"})), tiny_model())
    v = only(vs, "decode.kv_cache_dtype")
    assert "'fp8' vs decode 'auto'" in v.message and "fp8_" in v.message and "fp32_" in v.message


def test_page_layout_must_agree():
    v = only(validate(app(merged(CPU, decode={"page_layout": "per_layer"})), tiny_model()), "decode.page_layout")
    assert "'cross_layer' vs decode 'per_layer'" in v.message and "byte for byte" in v.message
    both = merged(CPU, prefill={"page_layout": "per_layer"}, decode={"page_layout": "per_layer"})
    assert validate(app(both), tiny_model()) == []


def test_auto_cache_dtype_must_agree():
    args = merged(CPU, prefill={"kv_cache_dtype": "auto"}, decode={"kv_cache_dtype": "auto", "dtype": "bfloat16"})
    v = only(validate(app(args), tiny_model()), "decode.dtype")
    assert "'float32' vs decode 'bfloat16'" in v.message


def test_mtp_presence_must_agree():
    args = merged(GPU, prefill={"mtp_draft_tokens": 0})
    v = only(validate(app(args), gpu_model()), "decode.mtp_draft_tokens")
    assert "MTP is on for decode only" in v.message and "prefill 4, decode 5" in v.message


def test_page_size_must_be_64_and_agree():
    vs = validate(app(merged(CPU, decode={"page_size": 128})), tiny_model())
    msgs = [v.message for v in vs if v.path == "decode.page_size"]
    assert len(vs) == len(msgs) == 2
    assert any("use 64-token pages" in m and "got 128" in m for m in msgs)
    assert any("prefill pages hold 64 tokens, decode pages 128" in m for m in msgs)


def test_compat_info_is_what_the_handshake_hashes(tmp_path):
    from attention.cache import CacheSpec, PagedKVCache
    from workers.kv_link import compat_info

    m = real_model("dsv32_pd.yaml")
    a = app(DSV32)
    p, d = role_compat_info(a, "prefill", m), role_compat_info(a, "decode", m)
    assert p == d and p.digest() == d.digest()
    assert (p.num_layers, p.page_size, p.kv_format, p.index_format, p.has_mtp) == (
        62, 64, "fp8_mla_656+index/cross_layer", "fp8_index_132", True)
    # The model field is the one a replica's link computes from the config.json it loads.
    (tmp_path / "config.json").write_text(json.dumps(yaml_args("dsv32_pd.yaml")["model"]["config"]))
    cache = PagedKVCache(CacheSpec(num_layers=1, num_pages=1, kv_lora_rank=512, rope_dim=64, index_head_dim=128,
                                   kv_cache_dtype="fp8", dtype=torch.bfloat16))
    assert p.model == compat_info(tmp_path, cache, has_mtp=True).model
    assert p.model.startswith("deepseek_v32:")
    bad = app(merged(DSV32, decode={"kv_cache_dtype": "auto"}))
    assert role_compat_info(bad, "decode", m).kv_format == "bf16_mla_576+index/cross_layer"
    assert role_compat_info(bad, "decode", m).digest() != p.digest()
    other = app(merged(DSV32, decode={"page_layout": "per_layer"}))
    assert role_compat_info(other, "decode", m).kv_format == "fp8_mla_656+index/per_layer"


def test_decode_mtp_needs_the_models_mtp_layer():
    m = gpu_model(num_nextn_predict_layers=0)
    vs = validate(app(GPU), m)
    v = only(vs, "decode.mtp_draft_tokens")
    assert "num_nextn_predict_layers 0" in v.message
    assert "prefill.mtp_draft_tokens" in paths(vs)  # prefill asks for it too
    assert validate(app(merged(GPU, prefill={"mtp_draft_tokens": 0}, decode={"mtp_draft_tokens": 0})), m) == []


# --------------------------------------------------------------------------- tensor parallelism


def test_tensor_parallel_size_must_divide_heads():
    # 8 heads, 8 experts, 128 dense columns, 32 shared-expert columns: 3 divides none.
    args = merged(CPU, prefill={"tensor_parallel_size": 3})
    vs = [v for v in validate(app(args), tiny_model()) if v.path == "prefill.tensor_parallel_size"]
    text = " | ".join(v.message for v in vs)
    assert "does not divide num_attention_heads (8)" in text
    assert "n_routed_experts (8)" in text and "intermediate_size (128)" in text
    assert "8 indexer heads are replicated" in text
    assert validate(app(merged(CPU, prefill={"tensor_parallel_size": 2}, decode={"tensor_parallel_size": 2})), tiny_model()) == []


def test_prefill_and_decode_tensor_parallel_sizes_must_agree():
    # Pages go prefill rank i -> decode rank i.
    vs = validate(app(merged(CPU, prefill={"tensor_parallel_size": 2}, decode={"tensor_parallel_size": 4})), tiny_model())
    v = only(vs, "decode.tensor_parallel_size")
    assert "prefill tensor_parallel_size 2 vs decode 4" in v.message and "rank i" in v.message


def test_fp8_weight_shards_must_align_to_blocks():
    raw = json.loads(json.dumps(DSV32["model"]["config"]))
    raw["moe_intermediate_size"] = 1536  # the shared expert's 1536 columns / 8 ranks = 192, not a multiple of 128
    from models.config import config_from_dict

    m = config_from_dict(raw)
    vs = validate(app(DSV32), m)
    v = [v for v in vs if v.path == "decode.tensor_parallel_size"]
    assert len(v) == 1 and "splits a scale block" in v[0].message, v
    assert "shared_experts.gate_proj: output shard of 192 rows is not a multiple of the fp8 block 128" in v[0].message


def test_flash_mla_heads_per_gpu():
    m = gpu_model(num_attention_heads=256, num_key_value_heads=256)
    v = only(validate(app(GPU), m), "decode.tensor_parallel_size")
    assert "256 per GPU exceed 128" in v.message and "tensor_parallel_size >= 2" in v.message
    # The reference backend has no head-count limit; 8 heads on cuda are padded to 64.
    assert validate(app(merged(CPU)), m) == []
    assert validate(app(GPU), gpu_model()) == []


# --------------------------------------------------------------------------- devices and GPUs


def test_cuda_backend_needs_cuda_device_and_bf16():
    vs = validate(app(merged(CPU, prefill={"backend": "cuda"})), tiny_model())
    assert "needs device 'cuda', got 'cpu'" in only(vs, "prefill.device").message
    assert "bf16 queries" in only(vs, "prefill.dtype").message


@pytest.mark.parametrize("pool, path, needle", [
    ({"num_gpus": 0}, "decode.num_gpus", "needs num_gpus > 0"),
    ({"num_gpus": 2}, "decode.num_gpus", "one GPU at most"),
    ({"tensor_parallel_size": 2, "num_gpus": 1}, "decode.num_gpus", "set num_gpus to 2"),
    ({"tensor_parallel_size": 8, "num_gpus": 8, "gpus_per_node": 4}, "decode.tensor_parallel_size", "one node of 4 GPUs"),
])
def test_gpu_counts(pool, path, needle):
    vs = validate(app(merged(GPU, decode=pool)), gpu_model())
    # (a decode tp other than prefill's is a violation at the same path too)
    assert len([v for v in vs if v.path == path and needle in v.message]) == 1, [str(v) for v in vs]


def test_cuda_graphs_need_the_cuda_backend_and_no_mtp_at_tensor_parallel():
    v = only(validate(app(merged(CPU, decode={"cuda_graphs": True})), tiny_model()), "decode.cuda_graphs")
    assert "backend 'reference', device 'cpu'" in v.message
    vs = validate(app(merged(GPU, decode={"cuda_graphs": True})), gpu_model())
    assert not [v for v in vs if v.path == "decode.cuda_graphs"]
    tp2 = {"tensor_parallel_size": 2, "num_gpus": 2}
    no_mtp = {"mtp_draft_tokens": 0}
    vs = validate(app(merged(GPU, prefill={**tp2, **no_mtp}, decode={**tp2, **no_mtp, "cuda_graphs": True})),
                  gpu_model())
    assert not [v for v in vs if v.path == "decode.cuda_graphs"], [str(v) for v in vs]
    mtp = {"mtp_draft_tokens": 1}
    vs = validate(app(merged(GPU, prefill={**tp2, **mtp}, decode={**tp2, **mtp, "cuda_graphs": True})), gpu_model())
    v = only(vs, "decode.cuda_graphs")
    assert "tensor_parallel_size 2" in v.message and "mtp_draft_tokens is 1" in v.message


def test_prefill_graphs_need_cuda_graphs_and_one_rank():
    v = only(validate(app(merged(CPU, decode={"prefill_graph_max_tokens": 512})), tiny_model()),
             "decode.prefill_graph_max_tokens")
    assert "CUDA graphs are off" in v.message and "backend 'reference'" in v.message
    for role in ("prefill", "decode"):
        vs = validate(app(merged(GPU, **{role: {"prefill_graph_max_tokens": 512}})), gpu_model())
        assert not [v for v in vs if v.path.endswith("prefill_graph_max_tokens")], [str(v) for v in vs]
        v = only(validate(app(merged(GPU, **{role: {"prefill_graph_max_tokens": 512, "cuda_graphs": False}})),
                          gpu_model()), f"{role}.prefill_graph_max_tokens")
        assert "cuda_graphs False" in v.message
    tp2 = {"tensor_parallel_size": 2, "num_gpus": 2, "mtp_draft_tokens": 0}
    vs = validate(app(merged(GPU, prefill={**tp2, "prefill_graph_max_tokens": 256}, decode=tp2)), gpu_model())
    assert "tensor_parallel_size is 2" in only(vs, "prefill.prefill_graph_max_tokens").message
    # 0 (off) is always fine
    vs = validate(app(merged(CPU, decode={"prefill_graph_max_tokens": 0})), tiny_model())
    assert not [v for v in vs if v.path.endswith("prefill_graph_max_tokens")]


def test_cpu_device_holds_no_gpus():
    v = only(validate(app(merged(CPU, decode={"num_gpus": 1})), tiny_model()), "decode.num_gpus")
    assert "device 'cpu'" in v.message


# --------------------------------------------------------------------------- context and memory


def test_num_pages_fit_one_max_length_request():
    m = gpu_model()  # max_position_embeddings 2048 -> 32 pages
    v = only(validate(app(merged(CPU, prefill={"num_pages": 31})), m), "prefill.num_pages")
    assert "max_model_len 2048" in v.message and "at least 32 pages" in v.message
    # Decode also needs room for what verification and the draft chain write (tokens_to_hold).
    assert tokens_to_hold(2047, 2) == 2052
    v = only(validate(app(merged(GPU, decode={"num_pages": 32, "mtp_draft_tokens": 2})), m), "decode.num_pages")
    assert "+ 4 positions written by MTP drafts" in v.message and "at least 33 pages" in v.message
    assert validate(app(merged(GPU, decode={"num_pages": 33, "mtp_draft_tokens": 2})), m) == []
    # A lower max_model_len lowers the need.
    args = merged(CPU, model={"max_model_len": 1024}, prefill={"num_pages": 16})
    assert validate(app(args), m) == []


def test_max_model_len_within_model():
    v = only(validate(app(merged(CPU, model={"max_model_len": 4096})), tiny_model()), "model.max_model_len")
    assert "max_position_embeddings (2048)" in v.message


def test_weights_that_do_not_fit_blame_tensor_parallelism():
    m = real_model("dsv32_pd.yaml")
    vs = validate(app(DSV32), m, gpu_memory_bytes=80 * GiB)  # H100
    for role in ("prefill", "decode"):
        v = only(vs, f"{role}.tensor_parallel_size")
        assert "weights alone exceed the budget" in v.message and "weights 88.52 GiB" in v.message


def test_page_pool_that_does_not_fit_blames_num_pages():
    m = real_model("dsv32_pd.yaml")
    est = estimate_memory(app(DSV32).decode, m)
    v = only(validate(app(merged(DSV32, decode={"num_pages": est.max_pages + 1})), m), "decode.num_pages")
    assert f"at most {est.max_pages} pages fit" in v.message
    assert validate(app(merged(DSV32, decode={"num_pages": est.max_pages})), m) == []


def test_fractional_gpu_gets_its_share_of_memory():
    pool = app(GPU).decode
    est = estimate_memory(pool, gpu_model())
    assert est.budget_bytes == int(80 * GiB * 0.9 * 0.5)
    assert estimate_memory(pool, gpu_model(), gpu_memory_bytes=40 * GiB).budget_bytes == int(40 * GiB * 0.9 * 0.5)


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_param_count_matches_the_model_code(arch):
    m = tiny_model(arch)
    for with_mtp in (True, False):
        with torch.device("meta"):
            model = DsaForCausalLM(m, with_mtp=with_mtp)
        assert model_param_count(m, with_mtp) == sum(p.numel() for p in model.parameters())


def test_real_scale_weight_estimates():
    ds, glm = real_model("dsv32_pd.yaml"), real_model("glm5_pd.yaml")
    # Published totals: DeepSeek-V3.2 671B main model; GLM-5 744B.
    assert 670e9 < model_param_count(ds, with_mtp=False) < 673e9
    assert 742e9 < model_param_count(glm, with_mtp=False) < 746e9
    fp8 = weight_bytes_per_rank(ds, 8, dtype="bfloat16", fp8_weights=True, with_mtp=True)
    bf16 = weight_bytes_per_rank(ds, 8, dtype="bfloat16", fp8_weights=False, with_mtp=True)
    assert 85 * GiB < fp8 < 92 * GiB and 1.8 < bf16 / fp8 < 2.0


def test_bytes_per_page_follow_the_formats():
    m = real_model("dsv32_pd.yaml")
    a = app(DSV32)
    assert bytes_per_page(a.decode, m) == 62 * 64 * 656 + 62 * 64 * 132  # MLA + indexer on all 61 + 1 layers
    glm = real_model("glm5_pd.yaml")
    computing = sum(glm.topk_plan.computes)  # 21 main layers + the MTP layer
    assert computing == 22
    assert bytes_per_page(app(GLM5).decode, glm) == 79 * 64 * 656 + computing * 64 * 132
    auto = app(merged(CPU, decode={"kv_cache_dtype": "auto"})).decode
    assert bytes_per_page(auto, tiny_model()) == 4 * 64 * (32 + 16) * 4 + 4 * 64 * 32 * 4  # fp32, no MTP


# --------------------------------------------------------------------------- all at once


def test_every_violation_reported_at_once():
    args = merged(
        DSV32,
        model={"max_model_len": 10**6},
        prefill={"backend": "cuda", "device": "cpu", "dtype": "float32", "num_gpus": 8},
        decode={"kv_cache_dtype": "auto", "tensor_parallel_size": 3, "num_gpus": 3, "num_pages": 10},
        features={"two_batch_overlap": True, "mtp_topk_reuse": True, "draft_topk": 4},
    )
    m = real_model("glm5_pd.yaml")
    vs = validate(app(args), m)
    expected = {
        "model.max_model_len", "prefill.device", "prefill.dtype", "prefill.num_gpus",
        "decode.kv_cache_dtype", "decode.tensor_parallel_size", "decode.num_pages",
        "features.two_batch_overlap", "features.mtp_topk_reuse",
    }
    assert expected <= set(paths(vs)), [str(v) for v in vs]
    with pytest.raises(AppConfigError) as exc:
        check_or_raise(app(args), m)
    assert exc.value.violations == tuple(vs)
    for path in expected:
        assert path in str(exc.value)


def test_check_args_reports_field_errors_with_paths():
    args = merged(CPU, decode={"num_page": 4, "mtp_draft_tokens": 4}, router={"policy": "random"})
    res = check_args(args)
    assert not res.ok and res.app_cfg is None
    assert set(paths(res.violations)) == {"decode.num_page", "decode.mtp_draft_tokens", "router.policy"}
    assert "unknown field" in only(res.violations, "decode.num_page").message
    assert "less than or equal to 3" in only(res.violations, "decode.mtp_draft_tokens").message


# --------------------------------------------------------------------------- model config resolution


def test_missing_checkpoint_without_inline_config(tmp_path):
    res = check_args(CPU | {"model": {"path": str(tmp_path / "nope")}})
    v = only(res.violations, "model.path")
    assert "no config.json" in v.message and "model.config" in v.message


def test_inline_config_is_checked_against_the_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_raw()))
    stale = tiny_raw(num_hidden_layers=6)
    cfg, vs = resolve_model_config(app(CPU | {"model": {"path": str(tmp_path), "config": stale}}))
    assert cfg is not None and cfg.num_hidden_layers == 4  # the checkpoint's config is served
    v = only(vs, "model.config")
    assert "num_hidden_layers" in v.message
    cfg, vs = resolve_model_config(app(CPU | {"model": {"path": str(tmp_path), "config": tiny_raw()}}))
    assert vs == []


def test_invalid_inline_config_names_its_field():
    bad = tiny_raw("glm_moe_dsa", index_topk_freq=0)
    res = check_args(CPU | {"model": {"path": "/nonexistent", "config": bad}})
    v = only(res.violations, "model.config")
    assert "index_topk_freq" in v.message


# --------------------------------------------------------------------------- placement


def test_placement_single_rank_cpu():
    plan = plan_placement(app(CPU))
    p = plan.prefill
    assert p.placement_group_bundles is None and p.rank_bundle_indices == ()
    assert p.ray_actor_options == {"num_cpus": 1.0, "num_gpus": 0.0}
    opts = plan.decode.deployment_options()
    assert opts == {"ray_actor_options": {"num_cpus": 1.0, "num_gpus": 0.0}, "max_ongoing_requests": 32,
                    "num_replicas": 1}
    assert plan.gpus == (0.0, 0.0)


def test_placement_shared_gpu_demo():
    plan = plan_placement(app(GPU))
    for role in ("prefill", "decode"):
        assert plan.for_role(role).ray_actor_options == {"num_cpus": 2.0, "num_gpus": 0.5}
        assert plan.for_role(role).placement_group_bundles is None
    assert plan.gpus == (1.0, 1.0)


def test_placement_tensor_parallel_strict_pack():
    plan = plan_placement(app(DSV32))
    d = plan.decode
    assert d.placement_group_bundles == tuple({"CPU": 4.0, "GPU": 1.0} for _ in range(8))
    assert d.placement_group_strategy == "STRICT_PACK"
    assert d.ray_actor_options == {"num_cpus": 0.0, "num_gpus": 0.0}  # the replica only orchestrates
    assert d.rank_actor_options == {"num_cpus": 4.0, "num_gpus": 1.0} and d.rank_bundle_indices == tuple(range(8))
    assert d.autoscaling_config == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 128.0}
    opts = d.deployment_options()
    assert "num_replicas" not in opts and opts["placement_group_strategy"] == "STRICT_PACK"
    assert len(opts["placement_group_bundles"]) == 8 and opts["max_ongoing_requests"] == 256
    assert plan.prefill.replica_range == (1, 1) and d.replica_range == (1, 4)
    assert plan.gpus == (16.0, 40.0)


def test_placement_tensor_parallel_on_cpu_has_no_gpu_bundles():
    plan = plan_placement(app(merged(CPU, prefill={"tensor_parallel_size": 2, "num_cpus": 3})))
    assert plan.prefill.placement_group_bundles == ({"CPU": 3.0}, {"CPU": 3.0})
    assert plan.prefill.rank_actor_options == {"num_cpus": 3.0, "num_gpus": 0.0}


# --------------------------------------------------------------------------- monolithic mode


def test_monolithic_refuses_a_prefill_section_by_name():
    assert "prefill" not in MONO and validate(app(MONO), tiny_model()) == []
    vs = validate(app(merged(MONO, prefill={"num_pages": 64})), tiny_model())
    v = only(vs, "prefill")
    assert "mode 'monolithic'" in v.message and "Remove it, or set mode to 'pd'" in v.message
    # An empty section is a section too; reported with every other violation, as always.
    res = check_args(merged(MONO, prefill={}, decode={"num_pages": 8, "backend": "cuda"}))
    assert {"prefill", "decode.num_pages", "decode.device", "decode.dtype"} <= set(paths(res.violations))
    # The same section is what pd mode wants.
    assert validate(app(merged(MONO, mode="pd", prefill=CPU["prefill"])), tiny_model()) == []


def test_mode_is_pd_or_monolithic():
    assert app(CPU).mode == "pd" and app(MONO).mode == "monolithic"
    assert (app(CPU).roles, app(MONO).roles) == (("prefill", "decode"), ("decode",))
    v = only(check_args(merged(MONO, mode="disaggregated")).violations, "mode")
    assert "'pd' or 'monolithic'" in v.message


def test_pd_rules_do_not_fire_in_monolithic_mode():
    # A decode section that disagrees with the (default) prefill role on every PD rule:
    # cache format, page layout, MTP presence, tensor-parallel size.
    decode = {"kv_cache_dtype": "fp8", "page_layout": "per_layer", "mtp_draft_tokens": 1,
              "tensor_parallel_size": 2}
    pd = validate(app(merged(MONO, mode="pd", decode=decode)), tiny_model())
    assert {"decode.kv_cache_dtype", "decode.page_layout", "decode.mtp_draft_tokens",
            "decode.tensor_parallel_size"} <= set(paths(pd))
    assert validate(app(merged(MONO, decode=decode)), tiny_model()) == []
    # Transfer settings are ignored, not refused.
    assert validate(app(merged(MONO, transfer={"deadline_s": 5, "push_threads": 0})), tiny_model()) == []


def test_monolithic_checks_only_the_decode_role():
    # The prefill role is not deployed: its (default) settings break no rule, whatever the model.
    m = gpu_model()
    assert validate(app(MONO_GPU), m) == []
    assert validate(app(merged(MONO_GPU, model={"max_model_len": 2048}, decode={"num_pages": 64})), m) == []
    # Device and memory rules apply to decode as in pd mode.
    v = only(validate(app(merged(MONO_GPU, decode={"num_gpus": 0.5, "num_pages": 400_000})), m), "decode.num_pages")
    assert "does not fit a GPU" in v.message


def test_monolithic_num_pages_hold_what_the_engine_admits():
    # The engine admits a request only if prompt + max_new_tokens fits the pool with what its
    # last step may write (Scheduler.add): one position more than max_model_len without MTP.
    from workers.page_pool import PagePool
    from workers.request import Request
    from workers.sample.params import SamplingParams
    from workers.scheduler import Scheduler, SchedulerConfig

    m = tiny_model()  # max_position_embeddings 2048 = 32 pages
    v = only(validate(app(merged(MONO, decode={"num_pages": 32})), m), "decode.num_pages")
    assert "+ 1 positions the engine holds at admission" in v.message and "at least 33 pages" in v.message
    assert validate(app(merged(MONO, decode={"num_pages": 33})), m) == []
    assert validate(app(merged(CPU, decode={"num_pages": 32})), m) == []  # pd: decode never admits a prompt
    v = only(validate(app(merged(MONO, decode={"num_pages": 32, "mtp_draft_tokens": 2})), m), "decode.num_pages")
    assert "+ 5 positions" in v.message and "at least 33 pages" in v.message
    # With a max_model_len one page short of the pool, the positions MTP holds need one more page.
    args = merged(MONO, model={"max_model_len": 2044}, decode={"num_pages": 32, "mtp_draft_tokens": 2})
    assert "at least 33 pages" in only(validate(app(args), m), "decode.num_pages").message
    assert validate(app(merged(args, model={"max_model_len": 2043})), m) == []

    def admitted(num_pages: int, k: int = 0, total: int = 2048) -> bool:
        req = Request("r", [1] * 2000, SamplingParams(max_new_tokens=total - 2000))
        Scheduler(PagePool(num_pages), SchedulerConfig(mtp_draft_tokens=k)).add(req)
        return not req.finished

    assert (admitted(32), admitted(33)) == (False, True)
    assert (admitted(32, k=2, total=2044), admitted(32, k=2, total=2043)) == (False, True)


def test_monolithic_placement_has_no_prefill_role():
    plan = plan_placement(app(MONO))
    assert plan.prefill is None and plan.placements == (plan.decode,)
    assert plan.decode.ray_actor_options == {"num_cpus": 1.0, "num_gpus": 0.0}
    with pytest.raises(ValueError, match="no prefill role"):
        plan.for_role("prefill")
    gpu = plan_placement(app(MONO_GPU))
    assert gpu.decode.ray_actor_options == {"num_cpus": 2.0, "num_gpus": 1.0} and gpu.gpus == (1.0, 1.0)
    # Tensor parallel: the decode replica's bundles only.
    tp = plan_placement(app(merged(MONO_GPU, decode={"tensor_parallel_size": 2, "num_gpus": 2, "num_replicas": None,
                                                     "autoscaling": {"min_replicas": 1, "max_replicas": 3}})))
    assert tp.decode.placement_group_bundles == ({"CPU": 2.0, "GPU": 1.0},) * 2 and tp.gpus == (2.0, 6.0)
