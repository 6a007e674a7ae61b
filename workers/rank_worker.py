"""One tensor-parallel rank of a replica: its model shard, its paged caches and
its NIXL agent, driven step by step by the replica's driver (`RankGroup`).

A `RankWorker` runs in its own process (a Ray actor, one GPU each on a GPU
host). Every rank runs every forward with the same ``ForwardBatch`` (the
driver builds it; page ids are the driver's, so they are the same on every
rank), and the ranks meet in the all-reduces of ``models/parallel.py`` over
their own process group (gloo on CPU, NCCL on GPU). Only rank 0 answers with
the hidden states: after the all-reduces they are the same bytes everywhere.

The MLA latent (and indexer keys) are shared by all heads, so every rank
caches them whole: pages of rank i are a full copy, and prefill rank i
pushes them to decode rank i with its own agent (``workers/group_link.py``).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket

import torch

from attention.cache import PagedKVCache
from models.parallel import TPContext
from transfer import PushResult, ReceiveResult
from workers.host_copy import to_device
from workers.kv_link import KVLink
from workers.rank_build import RankParts, RankSpec, build_rank
from workers.rank_rows import KeptRows, SampledTokens


def move_to(obj, device: torch.device):
    """A dataclass (``ForwardBatch``, the sampler's ``SamplingMetadata`` / ``TokenHistory`` /
    ``SampleOutput``), ``SelectedTokens``, tensor, tuple of those or None with every tensor on
    ``device`` (nested dataclasses and tuples included).

    Other fields are kept as they are: batch fields added later move (or stay host-side)
    without this helper knowing them.
    """
    if obj is None:
        return None
    if isinstance(obj, torch.Tensor):
        return to_device(obj, device)
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: _moved(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    if hasattr(obj, "slots") and hasattr(obj, "positions"):  # models.indexer.SelectedTokens
        packed = None if obj.packed is None else [to_device(p, device) for p in obj.packed]
        return type(obj)(to_device(obj.slots, device), to_device(obj.positions, device), packed)
    raise TypeError(f"cannot move a {type(obj).__name__} to {device}")


def _moved(value, device: torch.device):
    """A field's value on ``device``: tensors, dataclasses and tuples of them move; anything else stays."""
    if isinstance(value, torch.Tensor) or dataclasses.is_dataclass(value) and not isinstance(value, type):
        return move_to(value, device)
    if isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value):
        return tuple(_moved(v, device) for v in value)
    return value


class RankWorker:
    """Rank ``rank`` of ``size``. Construct, then `start` every rank at once
    (the process group rendezvous blocks until all ranks join)."""

    def __init__(self, spec: RankSpec, rank: int, size: int):
        self.spec, self.rank, self.size = spec, rank, size
        self.device = torch.device(spec.device)
        self.parts: RankParts | None = None
        self.model = None
        self.cache: PagedKVCache | None = None
        self.backend = None
        self.link: KVLink | None = None
        self.pusher = None
        self.receiver = None
        # request id -> its page list as this rank last saw it: kept across decode steps so the
        # decode graphs' inputs (`DecodeInputs.assign`, by list identity) copy only new pages.
        self._tables: dict[str, list[int]] = {}
        self._kept: tuple[int, torch.Tensor] | None = None  # (forward number, its hidden states): `forward`
        self._sampled: tuple[int, torch.Tensor] | None = None  # rank 0: (decode step number, its tokens)

    # ------------------------------------------------------------- set-up
    def rendezvous_address(self) -> str:
        """``tcp://host:port`` on this rank's host with a free port (asked of rank 0 only)."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        return f"tcp://{host}:{port}"

    def start(self, init_method: str, timeout_s: float = 300.0) -> tuple[int, int]:
        """Join the process group, load this rank's shard and allocate its caches.
        Returns (MTP layers loaded, this process's pid)."""
        import torch.distributed as dist

        stacks_s = float(os.environ.get("DSA_PD_RANK_STACKS_S", "0"))
        if stacks_s > 0:  # a debugging aid (bench/tp_probe.py): this rank's stacks every stacks_s seconds
            import faulthandler
            import sys

            faulthandler.dump_traceback_later(stacks_s, repeat=True, file=sys.stderr)
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            # Ray exposes this actor's one GPU as device 0.
            torch.cuda.set_device(0)
            self.device = torch.device("cuda", 0)
        dist.init_process_group("nccl" if on_gpu else "gloo", init_method=init_method, rank=self.rank,
                                world_size=self.size, timeout=datetime.timedelta(seconds=timeout_s))
        tp = TPContext(self.rank, self.size, dist.group.WORLD)
        self.parts = build_rank(self.spec, tp, str(self.device))
        self.model, self.cache, self.backend = self.parts.model, self.parts.cache, self.parts.runner.backend
        return len(self.model.mtp), os.getpid()

    # ------------------------------------------------------------- compute
    def _answer(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if self.rank or t is None else t.cpu()

    @torch.inference_mode()
    def forward(self, batch, forward_id: int) -> None:
        """Target model over ``batch``; its normed hidden ``[T, hidden]`` stay here as forward number
        ``forward_id`` (`workers.rank_rows`: every rank has the same bytes after the all-reduces) until
        the next forward."""
        self._kept = (forward_id, self.model(move_to(batch, self.device), self.cache, self.backend))

    def _kept_rows(self, kept: KeptRows) -> torch.Tensor:
        if self._kept is None:
            raise RuntimeError("no forward's hidden states are kept on this rank")
        return kept.take(*self._kept)

    @torch.inference_mode()
    def kept_rows(self, kept: KeptRows) -> torch.Tensor:
        """Rows of the kept hidden states (host)."""
        return self._kept_rows(kept).cpu()

    @torch.inference_mode()
    def kept_logits(self, kept: KeptRows) -> torch.Tensor:
        """fp32 ``[n, vocab]`` (host) of rows of the kept hidden states."""
        return self.model.logits(self._kept_rows(kept)).cpu()

    def sample_kept(self, kept: KeptRows, meta, history):
        """`sample_hidden` over rows of the kept hidden states."""
        return self.sample_hidden(self._kept_rows(kept), meta, history)

    @torch.inference_mode()
    def mtp_forward(self, batch, prev_hidden: torch.Tensor | KeptRows, depth: int, reuse, draft: bool = True,
                    rows: torch.Tensor | None = None):
        """``DsaForCausalLM.mtp_forward`` on this shard (``prev_hidden``: a tensor, or rows of the kept
        hidden states); rank 0 returns (fp32 logits ``[T, vocab]``,
        MTP hidden ``[T, hidden]``, selection) on the host (only ``rows`` of them when given), others
        None. ``draft=False`` (a prompt's prefill: only the cache pages are wanted): no head, and None
        from every rank."""
        prev = self._kept_rows(prev_hidden) if isinstance(prev_hidden, KeptRows) else to_device(prev_hidden, self.device)
        logits, hidden, selected = self.model.mtp_forward(
            move_to(batch, self.device), prev, self.cache, self.backend, depth,
            move_to(reuse, self.device), draft, move_to(rows, self.device))
        if self.rank or not draft:
            return None
        return logits.cpu(), hidden.cpu(), move_to(selected, torch.device("cpu"))

    def enable_decode_graphs(self, widths: tuple[int, ...], max_batch_size: int, max_context: int,
                             capture: bool) -> None:
        """`ModelRunner.enable_decode_graphs` on this rank: every rank captures the same buckets in the same
        order, its all-reduces inside the graphs (NCCL collectives replay with the graph)."""
        self.parts.runner.enable_decode_graphs(widths, max_batch_size, max_context, capture)

    def _step_here(self, step, token_patch):
        """``step`` with each request's page list replaced by this rank's kept list, grown in place
        (what a step pickled from the driver brings is a new list every time), and the patch's tokens
        on this rank's device."""
        kept: dict[str, list[int]] = {}
        tables = []
        for key, table in zip(step.keys, step.page_tables):
            mine = self._tables.get(key)
            if mine is None or len(table) < len(mine) or table[:len(mine)] != mine:
                mine = list(table)
            elif len(table) > len(mine):
                mine.extend(table[len(mine):])
            kept[key] = mine
            tables.append(mine)
        self._tables = kept
        patch = None
        if token_patch is not None:
            at, values = token_patch
            patch = (at, self._sampled_rows(values) if isinstance(values, SampledTokens) else to_device(values, self.device))
        return dataclasses.replace(step, page_tables=tables), patch

    def _sampled_rows(self, ref: SampledTokens) -> torch.Tensor:
        """int64 ``[m]`` on this device: rows of the tokens rank 0 sampled in its step ``ref.call``,
        broadcast from rank 0 (every rank runs this at the same point of the same call)."""
        import torch.distributed as dist

        values = torch.empty(len(ref.rows), dtype=torch.int64, device=self.device)
        if self.rank == 0:
            call, tokens = self._sampled if self._sampled is not None else (None, None)
            if call != ref.call:
                raise RuntimeError(f"tokens of decode step {ref.call} were asked for; rank 0 keeps step {call}'s")
            values.copy_(tokens.index_select(0, to_device(ref.rows, self.device)))
        dist.broadcast(values, src=0)
        return values

    @torch.inference_mode()
    def decode(self, step, token_patch=None) -> torch.Tensor | None:
        """`ModelRunner.decode` of ``step`` (a `workers.model_runner.DecodeStep`) on this rank, through its
        decode graphs when they cover the step; rank 0 returns hidden ``[R * width, hidden]`` (host)."""
        step, patch = self._step_here(step, token_patch)
        return self._answer(self.parts.runner.decode(step, patch))

    @torch.inference_mode()
    def decode_sample(self, step, token_patch, meta, history, call: int):
        """Decode step number ``call`` and its sampling in one call (`workers.rank_rows.RankHidden`): every
        rank runs ``step`` (its patch's tokens: host values, or `SampledTokens` of rank 0's previous step);
        rank 0 samples one token per request from the hidden it keeps on its device, keeps the tokens for
        the next step and returns the ``SampleOutput`` (host); the others return None."""
        step, patch = self._step_here(step, token_patch)
        hidden = self.parts.runner.decode(step, patch)
        if self.rank:
            return None
        out = self._sample_here(hidden, meta, history)
        self._sampled = (call, out.tokens)
        return move_to(out, torch.device("cpu"))

    @torch.inference_mode()
    def sample_hidden(self, hidden: torch.Tensor, meta, history):
        """`workers.sample.sampler.sample_hidden` on this rank's GPU: the head over hidden ``[n, hidden]``
        and one token per row; returns the ``SampleOutput`` on the host (tokens, the chosen tokens'
        logprobs, the top-n asked for: ``[n, 2 + 2 top]`` numbers, not ``[n, vocab]`` logits)."""
        return move_to(self._sample_here(hidden, meta, history), torch.device("cpu"))

    def _sample_here(self, hidden: torch.Tensor, meta, history):
        """The head and the sampler on this device; the ``SampleOutput`` stays here."""
        from workers.sample.sampler import sample

        return sample(self.model.logits(to_device(hidden, self.device)), move_to(meta, self.device),
                      move_to(history, self.device))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 ``[n, vocab]`` from hidden ``[n, hidden]`` (the head is replicated: no collective)."""
        return self.model.logits(hidden.to(self.device)).cpu()

    def two_batch_forwards(self) -> int:
        """Forwards this rank ran as two overlapped micro-batches (`models.two_batch`; 0 with it off)."""
        return self.model.two_batch.overlapped if self.model.two_batch is not None else 0

    # ------------------------------------------------------------ KV link
    # What `workers.group_link` fans out: this rank's agent, pusher and
    # receiver, called by the driver in the order the single-rank workers call
    # their own (one actor runs one call at a time: NIXL is used from one thread).
    def open_link(self, worker_id: str, epoch: int) -> bytes:
        """Register this rank's caches with a NIXL agent ``worker_id@epoch``; returns its handshake offer."""
        self.link = self.parts.open_link(worker_id, epoch)
        self.pusher = self.link.pusher()
        # Decode pages come back to the driver's pool, not here: record them for the next answer.
        self._released: list[tuple[int, ...]] = []
        self.receiver = self.link.receiver(release_pages=self._released.append)
        return self.link.peers.offer().to_bytes()

    def close_link(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None

    def accept(self, offer: bytes) -> str:
        return self.link.peers.accept(offer).agent_name

    def forget(self, agent_name: str) -> None:
        self.link.peers.forget(agent_name)

    def push_begin(self, request_id: str, peer_agent: str, prompt_len: int, local_pages: list[int],
                   remote_pages: list[int], deadline_s: float, prepare: bool = True) -> None:
        self.pusher.begin(request_id, peer_agent, prompt_len, local_pages, remote_pages, deadline_s, prepare)

    def push(self, request_id: str, tokens_done: int) -> bool:
        return self.pusher.push(request_id, tokens_done)

    def push_poll(self, spin_s: float = 0.0) -> list[PushResult]:
        return self.pusher.poll(spin_s)

    def push_abort(self, request_id: str, reason: str) -> PushResult | None:
        return self.pusher.abort(request_id, reason)

    def push_has_work(self) -> bool:
        return self.pusher.has_work()

    def warm_up(self, peer_agent: str, local_page: int, remote_page: int) -> float:
        return self.pusher.warm_up(peer_agent, local_page=local_page, remote_page=remote_page)

    def recv_expect(self, request_id: str, peer_agent: str | None, prompt_len: int, pages: list[int],
                    deadline_s: float) -> None:
        self.receiver.expect(request_id, peer_agent, prompt_len, pages, deadline_s)

    def _take_released(self) -> list[tuple[int, ...]]:
        out, self._released[:] = list(self._released), []
        return out

    def recv_poll(self) -> tuple[list[ReceiveResult], list[tuple[int, ...]]]:
        """(requests that ended, page tuples given back since the last answer)."""
        return self.receiver.poll(), self._take_released()

    def recv_cancel(self, request_id: str, reason: str) -> tuple[ReceiveResult | None, list[tuple[int, ...]]]:
        return self.receiver.cancel(request_id, reason), self._take_released()

    def recv_peer_of(self, request_id: str) -> str | None:
        return self.receiver.peer_of(request_id)

    def close(self) -> None:
        """Deregister from NIXL and leave the process group (before the actor is killed)."""
        import torch.distributed as dist

        self.close_link()
        captured = any(g.graphs for g in self.parts.runner.decode_graphs.values()) if self.parts else False
        # After NCCL collectives were captured in CUDA graphs, destroy_process_group hangs (pytorch#115388;
        # 2 x H200, bench/tp_probe.py): the process group then ends with the process (the actor is killed next).
        if dist.is_initialized() and not captured:
            dist.destroy_process_group()
