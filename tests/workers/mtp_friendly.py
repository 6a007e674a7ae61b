"""A tiny checkpoint whose MTP layer drafts well, so acceptance paths run.

A random MTP layer almost never agrees with the target, which would leave
every multi-token acceptance path untested. Here the main model is made
nearly a bigram model (its attention and MLP outputs scaled down, so the
prediction after token t is mostly ``lm_head(norm(emb(t)))``) and the MTP
layer exactly a bigram model of its input token (``eh_proj = [I | 0]``, its
decoder layer's output projections zeroed, its head = ``lm_head``). Drafts
then match the target often, but not always.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models.tiny import make_tiny


def make_mtp_friendly(arch: str, out: Path, seed: int = 5, layer_scale: float = 0.03, **dims) -> Path:
    """``dims``: config overrides for `models.tiny.make_tiny` (e.g. the serving attention dims)."""
    make_tiny(arch, out, seed=seed, **dims)
    cfg = json.loads((out / "config.json").read_text())
    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    tensors = {f: load_file(str(out / f)) for f in files}
    flat = {k: v for t in tensors.values() for k, v in t.items()}
    lm_head, norm = flat["lm_head.weight"], flat["model.norm.weight"]
    for f, t in tensors.items():
        for name, w in t.items():
            main = name.startswith("model.layers.") and int(name.split(".")[2]) < L
            mtp = name.startswith(f"model.layers.{L}.")
            out_proj = name.endswith(("o_proj.weight", "down_proj.weight"))
            if main and out_proj:
                t[name] = (w.float() * layer_scale).to(w.dtype)
            elif mtp and out_proj:
                t[name] = torch.zeros_like(w)
            elif mtp and name.endswith("eh_proj.weight"):
                t[name] = torch.cat([torch.eye(H), torch.zeros(H, H)], 1).to(w.dtype)
            elif mtp and name.endswith(("enorm.weight", "hnorm.weight")):
                t[name] = torch.ones_like(w)
            elif mtp and name.endswith("shared_head.norm.weight"):
                t[name] = norm.clone()
            elif mtp and name.endswith("shared_head.head.weight"):
                t[name] = lm_head.clone()
        save_file(t, str(out / f), metadata={"format": "pt"})
    return out
