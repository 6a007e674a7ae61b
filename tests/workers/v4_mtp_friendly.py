"""A tiny DeepSeek-V4 checkpoint whose MTP layer drafts well, so every acceptance length runs.

`models.tiny_v4`'s random MTP layer almost never agrees with the target (every draft rejected:
only the rejection path would run). Here, as `tests.workers.mtp_friendly` does for V3.2, the main
model is made nearly a bigram model (its blocks' output projections ``attn.wo_b``, experts' and
shared expert's ``w2`` scaled down: every stream stays close to a multiple of the embedding, and
``hc_head`` + ``norm`` are scale-free, so the prediction after token ``t`` is mostly
``head(norm(embed(t)))``) and the MTP layer exactly a bigram model of its input token: ``e_proj``
the identity, ``h_proj`` zero, ``enorm`` ones, its block's output projections zero (the streams stay
multiples of ``enorm(e)``), its ``norm`` the main model's. Drafts then match the target often, not always.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models.tiny_v4 import make_tiny_v4

_OUT_PROJ = ("attn.wo_b.weight", "w2.weight")  # attention output, routed and shared experts' down projections


def make_v4_mtp_friendly(out: Path, seed: int = 5, layer_scale: float = 0.03) -> Path:
    make_tiny_v4(out, seed=seed)
    cfg = json.loads((out / "config.json").read_text())
    D = cfg["hidden_size"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    tensors = {f: load_file(str(out / f)) for f in files}
    norm = next(t["model.norm.weight"] for t in tensors.values() if "model.norm.weight" in t)
    for f, t in tensors.items():
        for name, w in t.items():
            main, mtp = name.startswith("model.layers."), name.startswith("mtp.0.")
            if main and name.endswith(_OUT_PROJ):
                t[name] = (w.float() * layer_scale).to(w.dtype)
            elif mtp and name.endswith(_OUT_PROJ):
                t[name] = torch.zeros_like(w)
            elif name == "mtp.0.e_proj.weight":
                t[name] = torch.eye(D, dtype=w.dtype)
            elif name == "mtp.0.h_proj.weight":
                t[name] = torch.zeros_like(w)
            elif name == "mtp.0.enorm.weight":
                t[name] = torch.ones_like(w)
            elif name == "mtp.0.norm.weight":
                t[name] = norm.clone().to(w.dtype)
        save_file(t, str(out / f), metadata={"format": "pt"})
    return out
