"""A trained `DsaTrainModel` -> a Hugging Face checkpoint directory, in the real releases' layout.

``model-00001-of-00002.safetensors`` holds what transformers'
``DeepseekV32ForCausalLM`` loads; ``model-00002-of-00002.safetensors`` the
MTP layer under DeepSeek's names (``model.layers.{L}.enorm``, ``hnorm``,
``eh_proj``, ``shared_head.norm``, ``shared_head.head``, ``embed_tokens`` and
the decoder layer; the head and embedding copies equal the main ones), with
``model.safetensors.index.json`` over both (`models.tiny.add_mtp_shard`).
Weights are stored in ``dtype`` (bf16) except the routing correction bias
(float32, as in DeepSeek's releases).
"""

from __future__ import annotations

import argparse
import copy
import io
import shutil
import tarfile
from pathlib import Path

import torch

from models.tiny import add_mtp_shard, decoder_layer_tensors, to_checkpoint_dtype_
from models.train.dsa import DsaTrainModel

__all__ = ["export_checkpoint", "pack_parts", "unpack_parts"]

PART_PREFIX = "checkpoint.tar.part-"


def export_checkpoint(model: DsaTrainModel, out_dir: str | Path, tokenizer_dir: str | Path | None,
                      dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``model`` (config, weights, and the tokenizer found in ``tokenizer_dir``) to ``out_dir``.

    Existing safetensors in ``out_dir`` are replaced. Returns ``out_dir``.
    """
    from transformers import AutoTokenizer, DeepseekV32ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for p in list(out.glob("*.safetensors")) + list(out.glob("*.safetensors.index.json")):
        p.unlink()
    lm = copy.deepcopy(model.lm).cpu()
    to_checkpoint_dtype_(lm, dtype)
    lm.config.num_nextn_predict_layers = 1 if model.mtp is not None else 0
    lm.save_pretrained(out)
    if tokenizer_dir is not None:
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    if model.mtp is None:
        return out

    L = model.config.num_hidden_layers
    with torch.device("meta"):
        aux = DeepseekV32ForCausalLM(model.mtp_config)
    aux = aux.to_empty(device="cpu")
    aux.model.layers[0].load_state_dict(model.mtp.layer.state_dict())
    to_checkpoint_dtype_(aux, dtype)
    mtp = decoder_layer_tensors(aux, L)
    own = {"enorm.weight": model.mtp.enorm.weight, "hnorm.weight": model.mtp.hnorm.weight,
           "eh_proj.weight": model.mtp.eh_proj.weight, "shared_head.norm.weight": model.mtp.head_norm.weight,
           "shared_head.head.weight": model.lm.lm_head.weight,
           "embed_tokens.weight": model.lm.model.embed_tokens.weight}
    for name, t in own.items():
        mtp[f"model.layers.{L}.{name}"] = t.detach().to("cpu", dtype).clone()
    add_mtp_shard(out, mtp)
    return out


def pack_parts(src: str | Path, dst_dir: str | Path, part_bytes: int = 15 << 20) -> list[Path]:
    """``src`` as one uncompressed tar (``checkpoint/...``, sorted, mtimes 0) cut into
    ``dst_dir/checkpoint.tar.part-NN`` files of at most ``part_bytes``: the device machine returns
    at most 8 files of 16 MiB from a call, and a checkpoint's main shard is larger."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(Path(src).rglob("*")):
            info = tar.gettarinfo(str(path), arcname=str(Path("checkpoint") / path.relative_to(src)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if path.is_file():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    data = buf.getvalue()
    dst = Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    for old in dst.glob(PART_PREFIX + "*"):
        old.unlink()
    parts = []
    for i in range(0, len(data), part_bytes):
        p = dst / f"{PART_PREFIX}{i // part_bytes:02d}"
        p.write_bytes(data[i:i + part_bytes])
        parts.append(p)
    return parts


def unpack_parts(src_dir: str | Path, dst: str | Path) -> Path:
    """Join ``src_dir``'s ``checkpoint.tar.part-NN`` files and extract the checkpoint to ``dst``
    (replaced if it exists)."""
    parts = sorted(Path(src_dir).glob(PART_PREFIX + "*"))
    if not parts:
        raise FileNotFoundError(f"no {PART_PREFIX}NN files in {src_dir}")
    data = b"".join(p.read_bytes() for p in parts)
    dst = Path(dst)
    tmp = dst.parent / f".{dst.name}.unpack"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        tar.extractall(tmp, filter="data")
    if dst.exists():
        shutil.rmtree(dst)
    (tmp / "checkpoint").rename(dst)
    shutil.rmtree(tmp)
    return dst


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="unpack a checkpoint exported by models.train.train --export")
    ap.add_argument("src", help="the --export directory (holding checkpoint.tar.part-NN)")
    ap.add_argument("dst", help="where the checkpoint goes, e.g. models/checkpoints/small-v32")
    a = ap.parse_args(argv)
    print(unpack_parts(a.src, a.dst))


if __name__ == "__main__":
    main()
