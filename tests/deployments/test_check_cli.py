"""`dsa-pd check`: the shipped serve configs pass; broken ones list every violation with its path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import yaml

from deployments.cli import main
from deployments.serve_config import check_serve_config
from tests.deployments.app_fixtures import CONFIGS, YAMLS, merged, yaml_args


def test_shipped_configs_pass_the_console_script(tmp_path):
    exe = shutil.which("dsa-pd")
    cmd = [exe] if exe else [sys.executable, "-m", "deployments.cli"]
    # An empty cache: tiny configs must validate without making the model.
    env = dict(os.environ, DSA_PD_CACHE=str(tmp_path / "cache"))
    r = subprocess.run(cmd + ["check", *(str(CONFIGS / y) for y in YAMLS)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(": OK") == len(YAMLS)
    assert r.stdout.count("mode monolithic: decode replicas only") == 2  # tiny_mono.yaml, tiny_mono_gpu.yaml
    assert "GPUs: 16 to 40" in r.stdout  # the real-scale placements
    assert "top-k computed in 21 of 78 layers" in r.stdout  # GLM-5's sharing plan
    assert not (tmp_path / "cache").exists()


def _write(tmp_path, doc, name="app.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def _serve_doc(args, **app):
    return {"applications": [{"name": "pd", "route_prefix": "/", "import_path": "deployments.app:build_app",
                              "args": args, **app}]}


def test_violations_printed_with_paths_exit_1(tmp_path, capsys):
    args = merged(
        yaml_args("glm5_pd.yaml"),
        features={"two_batch_overlap": True},
        decode={"kv_cache_dtype": "auto", "num_pages": 100},
    )
    path = _write(tmp_path, _serve_doc(args))
    assert main(["check", path]) == 1
    out = capsys.readouterr().out
    assert "application 'pd' (applications[0]): 4 violation(s)" in out
    for line in ("args.features.two_batch_overlap: two-batch overlap is incompatible with DSA top-k sharing",
                 "args.decode.backend: the cuda attention backend needs the fp8 cache",
                 "args.decode.kv_cache_dtype: prefill kv_cache_dtype 'fp8' vs decode 'auto'",
                 "args.decode.num_pages: 100 pages hold 6400 tokens"):
        assert line in out, out


def test_field_errors_and_gpu_memory_override(tmp_path, capsys):
    args = merged(yaml_args("dsv32_pd.yaml"), prefill={"tensor_paralel_size": 8})
    path = _write(tmp_path, _serve_doc(args))
    assert main(["check", path]) == 1
    assert "args.prefill.tensor_paralel_size: unknown field (a typo?)" in capsys.readouterr().out
    # The real DeepSeek-V3.2 config does not fit 80 GiB GPUs at tp 8.
    assert main(["check", str(CONFIGS / "dsv32_pd.yaml"), "--gpu-memory-gib", "80"]) == 1
    out = capsys.readouterr().out
    assert "args.prefill.tensor_parallel_size: does not fit a GPU" in out
    assert "args.decode.tensor_parallel_size: does not fit a GPU" in out


def test_monolithic_plan_and_its_prefill_violation(tmp_path, capsys):
    assert main(["check", str(CONFIGS / "tiny_mono_gpu.yaml")]) == 0
    out = capsys.readouterr().out
    assert "mode monolithic: decode replicas only" in out and "transfer settings ignored" in out
    assert "  decode: 1 replica(s) x tp 1 (1 GPU each)" in out and "  prefill:" not in out
    assert "per GPU: weights" in out and "GPUs: 1\n" in out + "\n"
    path = _write(tmp_path, _serve_doc(merged(yaml_args("tiny_mono.yaml"), prefill={"num_cpus": 1})))
    assert main(["check", path]) == 1
    out = capsys.readouterr().out
    assert "1 violation(s)" in out and "args.prefill: mode 'monolithic' deploys decode replicas only" in out


def test_serve_schema_and_import_path(tmp_path, capsys):
    doc = _serve_doc(yaml_args("tiny_pd.yaml"), import_path="my.module:app")
    doc["applications"].append({"name": "broken", "route_prefix": "/x", "args": {}})
    path = _write(tmp_path, doc)
    assert main(["check", path]) == 1
    out = capsys.readouterr().out
    assert "application 'pd' (applications[0]): 1 violation(s)" in out
    assert "import_path: expected 'deployments.app:build_app', got 'my.module:app'" in out
    assert "application 'broken' (applications[1])" in out and "  import_path: required field missing" in out
    report = check_serve_config({"applications": []})
    assert not report.ok and report.file_violations[0].path == "applications"
    assert not check_serve_config(["not", "a", "mapping"]).ok


def test_unreadable_files_exit_2(tmp_path, capsys):
    assert main(["check", str(tmp_path / "missing.yaml")]) == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications: [\n")
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "cannot read" in err and "not valid YAML" in err


def test_existing_subcommands_still_parse(capsys):
    # `make-tiny` / `generate` are untouched: their parsers still reject a missing argument.
    try:
        main(["make-tiny"])
    except SystemExit as e:
        assert e.code == 2
    assert "--arch" in capsys.readouterr().err
