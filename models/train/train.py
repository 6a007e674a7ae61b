"""Train a small DeepSeek-V3.2 model (`models.train.arch`) on the offline corpus, time-boxed and resumable.

    python -m models.train.train --data .cache/corpus --out .cache/train-small-v32 --minutes 8 \\
        [--export DIR]

Three stages, by the fraction of the budget (``--minutes``, or ``--steps``)
spent (``--phases``, default ``dense=0.45,warmup=0.05,sparse=0.5``):

``dense``   the main model trains with dense causal attention on the LM loss
            plus ``--mtp-weight`` x the MTP layer's next-next-token loss; every
            indexer learns, from detached inputs, the KL towards its layer's
            dense attention distribution (`models.train.dsa`);
``warmup``  DeepSeek-V3.2's dense warm-up: the main model frozen, only the
            indexers train on that KL;
``sparse``  every layer attends to its indexer's ``index_topk`` positions; the
            main model trains on the same losses, the indexers on the KL
            restricted to the selected positions.

bf16 autocast on CUDA (fp32 master weights, AdamW), fp32 on CPU. Expert
load is balanced without an auxiliary loss, as DeepSeek-V3 does: after each
step every router's correction bias moves by ``--bias-rate`` towards the
experts that got fewer tokens than the mean.

``--out`` receives ``state.pt`` (model, optimizer, data position, time
spent; written every ``--save-every-s`` seconds: the same command resumes
where a cut-off run stopped), ``log.json`` (losses every ``--log-every``
steps, held-out losses every ``--eval-every-s`` seconds), and at the end
``checkpoint/`` (the Hugging Face checkpoint with MTP layer and tokenizer,
bf16, `models.train.export`), ``loss.png`` (or ``.svg``) and, with
``--export DIR``, a copy of those three in ``DIR``, the checkpoint as
``checkpoint.tar.part-NN`` files of 15 MiB (what a device call can return;
``python -m models.train.export DIR models/checkpoints/NAME`` unpacks them).

A budget longer than one device call: give the whole budget as ``--minutes``
and the call's share as ``--stop-after-minutes`` (wall clock of this process,
start-up included); a call that stops early saves its state and exits with
status 3 without exporting, and the same command continues.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from models.train.arch import arch_kwargs
from models.train.corpus import read_tokens
from models.train.dsa import DsaTrainModel
from models.train.export import export_checkpoint, pack_parts
from models.train.plot import plot_log

__all__ = ["TrainArgs", "parse_phases", "phase_at", "lr_scale", "train"]


@dataclass
class TrainArgs:
    data: str
    out: str
    minutes: float = 8.0
    steps: int | None = None
    arch: str = "small_v32"
    batch: int = 16
    seq_len: int = 1024
    lr: float = 2e-3
    indexer_lr: float = 1e-3
    min_lr_frac: float = 0.1
    warmup_frac: float = 0.03
    weight_decay: float = 0.1
    mtp_weight: float = 0.3
    bias_rate: float = 1e-3
    phases: str = "dense=0.45,warmup=0.05,sparse=0.5"
    save_every_s: float = 60.0
    eval_every_s: float = 30.0
    eval_every_steps: int | None = None
    eval_windows: int = 32
    log_every: int = 10
    seed: int = 0
    device: str = "auto"
    export: str | None = None
    stop_after_minutes: float | None = None


PHASES = ("dense", "warmup", "sparse")


def parse_phases(spec: str) -> list[tuple[str, float]]:
    """``"dense=0.45,warmup=0.05,sparse=0.5"`` -> [(phase, cumulative end fraction)]."""
    out, end = [], 0.0
    for part in spec.split(","):
        name, _, frac = part.partition("=")
        name = name.strip()
        if name not in PHASES:
            raise ValueError(f"--phases: unknown phase {name!r}; phases are {PHASES}")
        try:
            f = float(frac)
        except ValueError:
            raise ValueError(f"--phases: {part!r} needs a fraction, e.g. {name}=0.5") from None
        if f < 0:
            raise ValueError(f"--phases: fraction of {name!r} must be >= 0, got {f}")
        end += f
        out.append((name, end))
    if abs(end - 1.0) > 1e-6:
        raise ValueError(f"--phases: fractions must add up to 1, got {end}")
    return out


def phase_at(progress: float, phases: list[tuple[str, float]]) -> str:
    for name, end in phases:
        if progress < end:
            return name
    return phases[-1][0]


def lr_scale(progress: float, warmup: float, min_frac: float) -> float:
    """Linear warm-up over the first ``warmup`` of the run, then cosine down to ``min_frac``."""
    if progress < warmup:
        return (progress + 1e-3) / warmup
    t = min(1.0, (progress - warmup) / max(1e-9, 1.0 - warmup))
    return min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * t))


class _Data:
    """Random ``[B, S + 2]`` windows of the training tokens; fixed held-out windows."""

    def __init__(self, data_dir: Path, seq_len: int, batch: int, eval_windows: int, seed: int, device):
        self.train = torch.from_numpy(read_tokens(data_dir / "train.bin").astype(np.int32)).to(device)
        held = torch.from_numpy(read_tokens(data_dir / "heldout.bin").astype(np.int32))
        self.width, self.batch, self.device = seq_len + 2, batch, device
        if self.train.numel() <= self.width or held.numel() <= self.width:
            raise ValueError(f"corpus in {data_dir} is shorter than one window of {self.width} tokens")
        n = min(eval_windows, held.numel() // self.width)
        self.heldout = held[: n * self.width].view(n, self.width).long().to(device)
        self.gen = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(self.width)

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, self.train.numel() - self.width + 1, (self.batch,), generator=self.gen)
        return self.train[(starts[:, None] + self.offsets).to(self.device)].long()


def _param_groups(model: DsaTrainModel, a: TrainArgs) -> list[dict]:
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if ".indexer." in n:
            continue
        (decay if p.dim() >= 2 and "embed_tokens" not in n else no_decay).append(p)
    return [{"params": decay, "weight_decay": a.weight_decay, "base_lr": a.lr, "name": "main"},
            {"params": no_decay, "weight_decay": 0.0, "base_lr": a.lr, "name": "main_no_decay"},
            {"params": model.indexer_parameters(), "weight_decay": 0.0, "base_lr": a.indexer_lr, "name": "indexer"}]


class Trainer:
    def __init__(self, a: TrainArgs):
        self.started = time.monotonic()
        self.a = a
        self.out = Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.data_dir = Path(a.data)
        manifest = json.loads((self.data_dir / "manifest.json").read_text())
        if a.device == "auto":
            a.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(a.device)
        self.phases = parse_phases(a.phases)
        torch.manual_seed(a.seed)
        kw = arch_kwargs(a.arch, vocab_size=manifest["vocab_size"])
        if a.seq_len > kw["max_position_embeddings"]:
            raise ValueError(f"--seq-len {a.seq_len} exceeds the architecture's max_position_embeddings "
                             f"({kw['max_position_embeddings']})")
        self.model = DsaTrainModel(kw).to(self.device)
        self.opt = torch.optim.AdamW(_param_groups(self.model, a), lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
        self.data = _Data(self.data_dir, a.seq_len, a.batch, a.eval_windows, a.seed, self.device)
        self.step, self.elapsed, self.tokens = 0, 0.0, 0
        self.log = {"args": asdict(a), "arch": kw, "corpus": {k: manifest[k] for k in ("documents", "characters")},
                    "env": {"torch": torch.__version__, "python": platform.python_version(),
                            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"},
                    "train": [], "eval": []}
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self._resume()

    # ------------------------------------------------------------------ state
    def _resume(self) -> None:
        path = self.out / "state.pt"
        if not path.exists():
            return
        s = torch.load(path, map_location=self.device, weights_only=False)
        if s["arch"] != self.log["arch"]:
            raise ValueError(f"{path} was written for another architecture; use a fresh --out")
        self.model.load_state_dict(s["model"])
        self.opt.load_state_dict(s["opt"])
        self.data.gen.set_state(s["data_gen"])
        self.step, self.elapsed, self.tokens = s["step"], s["elapsed"], s["tokens"]
        self.log["train"], self.log["eval"] = s["log_train"], s["log_eval"]
        print(f"resumed from {path}: step {self.step}, {self.elapsed:.0f} s spent", flush=True)

    def _save(self) -> None:
        tmp = self.out / "state.pt.tmp"
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(), "data_gen": self.data.gen.get_state(),
                    "step": self.step, "elapsed": self.elapsed, "tokens": self.tokens, "arch": self.log["arch"],
                    "log_train": self.log["train"], "log_eval": self.log["eval"]}, tmp)
        os.replace(tmp, self.out / "state.pt")
        self._write_log()

    def _write_log(self) -> None:
        tmp = self.out / "log.json.tmp"
        tmp.write_text(json.dumps(self.log, indent=1) + "\n")
        os.replace(tmp, self.out / "log.json")

    # ------------------------------------------------------------------ loop
    def progress(self) -> float:
        if self.a.steps is not None:
            return self.step / self.a.steps
        return self.elapsed / (self.a.minutes * 60.0)

    def _autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else torch.autocast(
            "cpu", enabled=False)

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.model.eval()
        res = {}
        for mode in ("sparse", "dense"):
            lm, mtp, kl = [], [], []
            for i in range(0, self.data.heldout.shape[0], self.a.batch):
                with self._autocast():
                    o = self.model(self.data.heldout[i:i + self.a.batch], mode)
                lm.append(o["lm_loss"].item())
                kl.append(o["indexer_kl"].item())
                if o["mtp_loss"] is not None:
                    mtp.append(o["mtp_loss"].item())
            res[mode] = (float(np.mean(lm)), float(np.mean(mtp)) if mtp else None, float(np.mean(kl)))
        self.model.train()
        e = {"step": self.step, "tokens": self.tokens, "time_s": round(self.elapsed, 1),
             "phase": phase_at(self.progress(), self.phases), "lm_loss": res["sparse"][0],
             "mtp_loss": res["sparse"][1], "indexer_kl": res["sparse"][2], "dense_lm_loss": res["dense"][0],
             "dense_mtp_loss": res["dense"][1]}
        self.log["eval"].append(e)
        print(f"eval step {self.step}: held-out LM {e['lm_loss']:.3f} (dense {e['dense_lm_loss']:.3f}) "
              f"MTP {e['mtp_loss']} KL {e['indexer_kl']:.4f}", flush=True)
        return e

    def train_step(self, phase: str) -> dict:
        a = self.a
        batch = self.data.next()
        frac = self.progress()
        scale = lr_scale(frac, a.warmup_frac, a.min_lr_frac)
        for g in self.opt.param_groups:
            g["lr"] = g["base_lr"] * scale
        train_main = phase != "warmup"
        mode = "sparse" if phase == "sparse" else "dense"
        with self._autocast():
            o = self.model(batch, mode, train_main=train_main)
        loss = o["indexer_kl"]
        if train_main:
            loss = loss + o["lm_loss"] + (a.mtp_weight * o["mtp_loss"] if o["mtp_loss"] is not None else 0.0)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.main_parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(self.model.indexer_parameters(), 1.0)
        self.opt.step()
        if train_main and o["expert_load"] is not None and a.bias_rate > 0:
            with torch.no_grad():
                load = o["expert_load"].float()
                for router, l in zip(self.model.routers(), load):
                    router.e_score_correction_bias.add_(a.bias_rate * torch.sign(l.mean() - l))
        self.step += 1
        self.tokens += batch.shape[0] * (batch.shape[1] - 2)
        return o

    def _out_of_session(self) -> bool:
        a = self.a
        return a.stop_after_minutes is not None and time.monotonic() - self.started >= a.stop_after_minutes * 60

    def run(self) -> Path | None:
        """Train to the end of the budget and export; None when ``--stop-after-minutes`` came first."""
        a = self.a
        acc: dict[str, list] = {"lm": [], "mtp": [], "kl": [], "cv": []}
        last_save = last_eval = time.monotonic()
        window_start, window_tokens = time.monotonic(), self.tokens
        if not self.log["eval"]:
            self.evaluate()
        self.model.train()
        while self.progress() < 1.0:
            t0 = time.monotonic()
            phase = phase_at(self.progress(), self.phases)
            o = self.train_step(phase)
            acc["lm"].append(o["lm_loss"].detach())
            acc["kl"].append(o["indexer_kl"].detach())
            if o["mtp_loss"] is not None:
                acc["mtp"].append(o["mtp_loss"].detach())
            if o["expert_load"] is not None:
                l = o["expert_load"].float()
                acc["cv"].append((l.std(-1) / l.mean(-1)).mean())
            if self.step % a.log_every == 0:
                now = time.monotonic()
                e = {"step": self.step, "tokens": self.tokens, "time_s": round(self.elapsed, 1), "phase": phase,
                     "lr": self.opt.param_groups[0]["lr"],
                     "lm_loss": torch.stack(acc["lm"]).mean().item(),
                     "mtp_loss": torch.stack(acc["mtp"]).mean().item() if acc["mtp"] else None,
                     "indexer_kl": torch.stack(acc["kl"]).mean().item(),
                     "expert_load_cv": torch.stack(acc["cv"]).mean().item() if acc["cv"] else None,
                     "tokens_per_s": round((self.tokens - window_tokens) / max(1e-9, now - window_start))}
                self.log["train"].append(e)
                print(f"step {self.step} [{phase}] {self.elapsed:.0f}s LM {e['lm_loss']:.3f} MTP {e['mtp_loss']} "
                      f"KL {e['indexer_kl']:.4f} load-cv {e['expert_load_cv']} {e['tokens_per_s']} tok/s", flush=True)
                acc = {k: [] for k in acc}
                window_start, window_tokens = now, self.tokens
            self.elapsed += time.monotonic() - t0
            now = time.monotonic()
            due_eval = (self.step % a.eval_every_steps == 0) if a.eval_every_steps else now - last_eval >= a.eval_every_s
            if due_eval:
                t1 = time.monotonic()
                self.evaluate()
                self.elapsed += time.monotonic() - t1
                last_eval = time.monotonic()
            if time.monotonic() - last_save >= a.save_every_s:
                self._save()
                last_save = time.monotonic()
            if self._out_of_session() and self.progress() < 1.0:
                self._save()
                print(f"stopped at step {self.step} ({self.progress():.0%} of the budget): run the same command "
                      "again to continue", flush=True)
                return None
        if not self.log["eval"] or self.log["eval"][-1]["step"] != self.step:
            self.evaluate()
        self._save()
        return self.finish()

    def finish(self) -> Path:
        ckpt = export_checkpoint(self.model, self.out / "checkpoint", self.data_dir / "tokenizer")
        last = self.log["eval"][-1]
        info = {"arch": self.a.arch, "steps": self.step, "tokens": self.tokens, "minutes": round(self.elapsed / 60, 2),
                "held_out": {k: last[k] for k in ("lm_loss", "mtp_loss", "indexer_kl", "dense_lm_loss")},
                "corpus": self.log["corpus"], "env": self.log["env"],
                "command": "python -m models.train.train " + " ".join(
                    f"--{k.replace('_', '-')} {v}" for k, v in asdict(self.a).items()
                    if v is not None and k not in ("out", "export", "device", "stop_after_minutes"))}
        (ckpt / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
        plot = plot_log(self.log, self.out / "loss.png", title=f"{self.a.arch}: {self.tokens / 1e6:.0f}M tokens, "
                        f"{self.log['env']['device']}")
        if self.a.export:
            dst = Path(self.a.export)
            dst.mkdir(parents=True, exist_ok=True)
            pack_parts(ckpt, dst)
            shutil.copy(self.out / "log.json", dst / "log.json")
            shutil.copy(plot, dst / plot.name)
        print(f"checkpoint: {ckpt}; held-out LM {last['lm_loss']:.3f} MTP {last['mtp_loss']}", flush=True)
        return ckpt


def train(a: TrainArgs) -> Path | None:
    """Run (or resume) the training described by ``a``; returns the checkpoint directory
    (None: stopped by ``stop_after_minutes`` before the end of the budget)."""
    return Trainer(a).run()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = TrainArgs(data="", out="")
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if name in ("data", "out"):
            ap.add_argument(flag, required=True)
        elif name in ("steps", "eval_every_steps"):
            ap.add_argument(flag, type=int, default=None)
        elif name == "stop_after_minutes":
            ap.add_argument(flag, type=float, default=None)
        elif name == "export":
            ap.add_argument(flag, default=None)
        else:
            ap.add_argument(flag, type=type(value), default=value)
    if train(TrainArgs(**vars(ap.parse_args(argv)))) is None:
        raise SystemExit(3)


if __name__ == "__main__":
    main()
