"""The `dsa-pd` console script, run the way a user runs it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys



def _run(args, tmp_path, **kw):
    exe = shutil.which("dsa-pd")
    cmd = [exe] if exe else [sys.executable, "-m", "deployments.cli"]
    env = dict(os.environ, DSA_PD_CACHE=str(tmp_path / "cache"))
    return subprocess.run(cmd + args, capture_output=True, text=True, env=env, timeout=300, **kw)


def test_make_tiny_then_generate_text_and_ids(tmp_path):
    out = tmp_path / "tiny"
    r = _run(["make-tiny", "--arch", "glm_moe_dsa", str(out)], tmp_path)
    assert r.returncode == 0, r.stderr
    assert (out / "config.json").exists() and (out / "model.safetensors.index.json").exists()
    r = _run(["generate", str(out), "--prompt", "Hi", "--max-new-tokens", "4"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "generated text:" in r.stdout
    r2 = _run(["generate", str(out), "--token-ids", "256,72,105", "--max-new-tokens", "4"], tmp_path)
    assert r2.returncode == 0, r2.stderr
    # Same prompt ids ("<|bos|>Hi"), greedy: same tokens either way.
    ids = lambda s: [l for l in s.splitlines() if l.startswith("generated ids")][0]
    assert ids(r.stdout) == ids(r2.stdout)


def test_generate_tiny_from_cache_dir(tmp_path):
    r = _run(["generate", "--tiny", "deepseek_v32", "--max-new-tokens", "3", "--kv-cache-dtype", "fp8"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "cache" / "tiny-deepseek_v32-s0" / "config.json").exists()


def test_bad_arguments_fail_clearly(tmp_path):
    r = _run(["generate"], tmp_path)
    assert r.returncode == 2 and "MODEL_DIR or --tiny" in r.stderr
    r = _run(["generate", str(tmp_path / "missing"), "--token-ids", "1,2"], tmp_path)
    assert r.returncode == 2 and "config.json not readable" in r.stderr and "Traceback" not in r.stderr
