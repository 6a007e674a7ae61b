"""The one build path: what `dsa-pd check` plans for a role is what `build_rank` allocates,
and the offline ``LLM`` and a served replica build the same rank from the same spec."""

from __future__ import annotations

import pytest

from deployments.app_config import AppConfig
from deployments.controller import estimate_memory
from models.config import load_config
from models.dtypes import DTYPES, dtype_bytes, torch_dtype
from models.tiny import make_tiny
from tests.deployments.app_fixtures import merged, yaml_args
from workers.offline import LLM
from workers.rank_build import RankSpec, build_rank


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny("glm_moe_dsa", tmp_path_factory.mktemp("tiny-build"), seed=3)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "auto"])
@pytest.mark.parametrize("mtp", [0, 1])
@pytest.mark.parametrize("page_layout", ["cross_layer", "per_layer"])
def test_the_memory_plan_is_what_loading_allocates(tiny_dir, kv_cache_dtype, mtp, page_layout):
    args = merged(yaml_args("tiny_pd.yaml"),
                  decode={"num_pages": 24, "kv_cache_dtype": kv_cache_dtype, "mtp_draft_tokens": mtp,
                          "page_layout": page_layout})
    role = AppConfig.model_validate(args).decode
    rank = build_rank(role.rank_spec(tiny_dir))
    allocated = sum(r.tensor.numel() * r.tensor.element_size() for r in rank.cache.regions())
    assert estimate_memory(role, load_config(tiny_dir)).page_bytes == allocated
    assert len(rank.model.mtp) == mtp  # the MTP layer is loaded only where drafts use it


def test_offline_and_served_ranks_are_built_alike(tiny_dir):
    llm = LLM(tiny_dir, kv_cache_dtype="fp8", num_pages=24)
    served = build_rank(RankSpec(str(tiny_dir), kv_cache_dtype="fp8", num_pages=24))
    assert llm.cache.spec == served.cache.spec
    assert llm.model.layers[0].self_attn.indexer.hadamard == served.model.layers[0].self_attn.indexer.hadamard


def test_one_dtype_table():
    assert {name: dtype_bytes(name) for name in DTYPES} == {"float32": 4, "bfloat16": 2}
    with pytest.raises(ValueError, match=r"dtype must be one of \['bfloat16', 'float32'\], got 'fp16'"):
        torch_dtype("fp16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        RankSpec("unused", dtype="fp16")
