"""The ranks of one tensor-parallel replica, seen from its driver.

The driver (one process: scheduler, page pool, sampler — the `Engine`,
`PrefillWorker` or `DecodeWorker` of the replica) runs unchanged on top of
`GroupRunner` / `GroupModel`, which present the `ModelRunner` /
`DsaForCausalLM` calls it makes and fan each forward out to the rank actors
(``workers.rank_worker.RankWorker``, one Ray actor per rank, one GPU each on
a GPU host): every rank runs the same batch, built by the driver with the
driver's page ids, and rank 0 answers. Page ids mean the same on every rank
because the driver's one `PagePool` hands them out and every rank's cache has
``num_pages`` pages.

Where the ranks run: ``actor_options[r]`` are rank r's Ray actor options
(resources, and in a Serve replica the placement group and bundle index the
controller planned). The process group is gloo on CPU and NCCL on GPU; rank 0
picks the rendezvous address on its own host.

If a rank raises, the ranks' collectives are out of step for good: the group
is marked broken and every later call raises `RankGroupFailed` (a Serve
replica then fails its health check and is replaced; its actors die with it).

Hidden states stay on the ranks (`workers.rank_rows`). A forward's are kept
there and the driver holds a handle: rank 0 samples the rows the engine picks,
each rank gathers the MTP layer's inputs from its own copy. A width-1 decode
step (no MTP) is one call per rank that runs the step (through each rank's own
decode graphs, all-reduces captured inside them) and samples on rank 0
(`RankHidden`, `RankWorker.decode_sample`): only the sampled rows come back,
and the driver waits for them only when it reads them (`PendingSample`), so
with overlap scheduling it prepares step n + 1 while the ranks run step n;
step n + 1's input tokens go from rank 0's device to the others (a broadcast),
not through the driver.
An MTP verify's hidden states still come to the driver whole.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from models.config import load_config
from models.dtypes import torch_dtype
from workers.group_link import GroupLink
from workers.decode_graphs import DecodeGraphPlan
from workers.model_runner import DecodeStep, ModelRunner, TokenPatch
from workers.rank_build import RankSpec
from workers.rank_rows import KeptRows, RankHidden, RankRows, host_patch
from workers.rank_worker import RankWorker


class RankGroupFailed(RuntimeError):
    """A rank failed; the group cannot run another collective."""


class RankGroup:
    """``size`` rank actors of one replica, started and joined in one process group.

    actor_options: one dict of Ray actor options per rank (default: no
    resources on CPU, one GPU per rank on ``cuda``).
    """

    def __init__(self, spec: RankSpec, size: int, actor_options: Sequence[dict[str, Any]] | None = None,
                 start_timeout_s: float = 600.0):
        import ray

        if size < 2:
            raise ValueError(f"a rank group has >= 2 ranks (one rank runs in-process), got {size}")
        if actor_options is None:
            one = {"num_cpus": 0, "num_gpus": 1 if spec.device.startswith("cuda") else 0}
            actor_options = [one] * size
            if one["num_gpus"]:
                if not ray.is_initialized():
                    ray.init()
                free = ray.available_resources().get("GPU", 0)
                if free < size:
                    # Otherwise the actors wait for GPUs that never come (found on 2 x H200:
                    # a tp=2 pd=True LLM needs 4).
                    raise RuntimeError(f"{size} rank workers need {size} free GPUs, Ray has {free:g} free "
                                       f"(of {ray.cluster_resources().get('GPU', 0):g})")
        if len(actor_options) != size:
            raise ValueError(f"{len(actor_options)} actor option sets for {size} ranks")
        self.spec, self.size = spec, size
        self.broken: BaseException | None = None
        cls = ray.remote(RankWorker)
        # max_concurrency 1 (the default): a rank runs one call at a time, in order.
        self.actors = [cls.options(**dict(opts)).remote(spec, r, size) for r, opts in enumerate(actor_options)]
        address = self._wait([self.actors[0].rendezvous_address.remote()], start_timeout_s)[0]
        started = self._wait([a.start.remote(address, start_timeout_s) for a in self.actors], start_timeout_s)
        self.pids = [pid for _, pid in started]
        self.model = GroupModel(self, spec, started[0][0])
        self.runner = GroupRunner(self.model)

    # ------------------------------------------------------------ fan-out
    def _wait(self, refs: list, timeout_s: float | None = None, return_exceptions: bool = False) -> list:
        """Results of ``refs`` in order. A rank's error is raised as soon as it is known (not after
        the others, which may wait forever in a collective it left) and breaks the group."""
        import ray

        pending = list(refs)
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            left = None if end is None else max(0.0, end - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not done:
                self.broken = RankGroupFailed(f"ranks did not answer within {timeout_s:.0f}s")
                raise self.broken
            if not return_exceptions:
                try:
                    ray.get(done[0])
                except Exception as e:
                    self.broken = e
                    raise RankGroupFailed(f"a rank failed: {e}") from e
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref))
            except Exception as e:  # noqa: BLE001 - return_exceptions: the caller decides
                out.append(e.as_instanceof_cause() if hasattr(e, "as_instanceof_cause") else e)
        return out

    def _check(self) -> None:
        if self.broken is not None:
            raise RankGroupFailed(f"the rank group failed earlier: {self.broken!r}") from self.broken

    def call(self, method: str, *args) -> list:
        """``method(*args)`` on every rank; every rank's result, in rank order."""
        return self.results(self.submit(method, *args))

    def submit(self, method: str, *args) -> list:
        """Start ``method(*args)`` on every rank without waiting (each rank runs its calls in the order
        they were submitted); `results` waits for them."""
        self._check()
        return [getattr(a, method).remote(*args) for a in self.actors]

    def results(self, refs: list) -> list:
        """Every rank's result of a `submit`, in rank order."""
        return self._wait(refs)

    def call_each(self, method: str, args: Sequence[tuple], return_exceptions: bool = False) -> list:
        """``method(*args[r])`` on rank r; with ``return_exceptions`` a rank's error is its result
        (for calls without collectives, e.g. a transfer ``begin`` that one rank refuses)."""
        self._check()
        refs = [getattr(a, method).remote(*args[r]) for r, a in enumerate(self.actors)]
        return self._wait(refs, return_exceptions=return_exceptions)

    def call_rank(self, rank: int, method: str, *args):
        """One rank only: never for a call that runs a collective."""
        self._check()
        return self._wait([getattr(self.actors[rank], method).remote(*args)])[0]

    def link(self, worker_id: str, epoch: int | None = None) -> GroupLink:
        """Open every rank's NIXL agent (``worker_id.r<i>@epoch``) and return the replica's link."""
        from transfer.agent import new_epoch

        return GroupLink(self, worker_id, new_epoch() if epoch is None else epoch)

    def shutdown(self) -> None:
        """Close the ranks' NIXL agents and process group, then end the actors."""
        import ray

        if self.broken is None:
            try:  # bounded: a rank stuck in teardown must not hold the replica's shutdown
                self._wait([a.close.remote() for a in self.actors], timeout_s=60.0)
            except Exception:  # noqa: BLE001 - ending anyway
                pass
        for a in self.actors:
            ray.kill(a)
        self.actors = []
        self.broken = RankGroupFailed("shut down")


class GroupModel:
    """The driver's handle on the model sharded over a `RankGroup`: the
    ``DsaForCausalLM`` calls the engine and workers make (``cache`` /
    ``backend`` arguments are the ranks' own and ignored here)."""

    def __init__(self, group: RankGroup, spec: RankSpec, num_mtp: int):
        self.group = group
        self.cfg = load_config(spec.model_dir)
        self.dtype = torch_dtype(spec.dtype)
        # The engine reads how many MTP layers there are (len); the layers live on the ranks.
        self.mtp = tuple(range(num_mtp))
        self.forwards = 0
        """Forwards run; the ranks keep the last one's hidden states (`workers.rank_rows.KeptRows`)."""
        self.decode_samples = 0
        """Decode steps sampled on rank 0; it keeps the last one's tokens (`workers.rank_rows.SampledTokens`)."""

    @property
    def num_cache_layers(self) -> int:
        return self.cfg.num_hidden_layers + len(self.mtp)

    def __call__(self, batch, cache=None, backend=None) -> RankRows:
        """The target model over ``batch``: its normed hidden ``[T, hidden]`` stay on the ranks, the driver
        gets a handle (`workers.rank_rows.RankRows`: rows come back only where a torch op needs them)."""
        self.group.call("forward", batch, self.forwards + 1)
        self.forwards += 1
        return RankRows(self, KeptRows(self.forwards, None), int(batch.input_ids.shape[0]),
                        self.cfg.hidden_size, self.dtype)

    def logits(self, hidden) -> torch.Tensor:
        """fp32 ``[n, vocab]``; the head is replicated, so rank 0 alone computes it (over the rows it keeps,
        for a `RankRows`)."""
        if isinstance(hidden, RankRows):
            return self.group.call_rank(0, "kept_logits", hidden.kept)
        return self.group.call_rank(0, "logits", hidden)

    def sample_hidden(self, hidden, meta, history=None):
        """One token per row of hidden ``[n, hidden]`` (host), sampled on rank 0's device: only the
        ``SampleOutput`` comes back, not ``[n, vocab]`` fp32 logits (16.5 MB at n = 32 for DeepSeek-V3.2,
        which the driver then sampled on its CPU: ~130 of a 190 ms tp 2 decode step on H200s).
        A `RankHidden` (a decode step not run yet): the step and its sampling in one call per rank."""
        if isinstance(hidden, RankHidden):
            return hidden.sample(meta, history)
        if isinstance(hidden, RankRows):
            return self.group.call_rank(0, "sample_kept", hidden.kept, meta, history)
        return self.group.call_rank(0, "sample_hidden", hidden, meta, history)

    def mtp_forward(self, batch, prev_hidden: torch.Tensor, cache=None, backend=None, depth: int = 0, reuse=None,
                    draft: bool = True, rows: torch.Tensor | None = None):
        """As ``DsaForCausalLM.mtp_forward``: (fp32 logits ``[T, vocab]``, hidden ``[T, hidden]``, selection),
        only ``rows`` of them when given; None with ``draft=False`` (the ranks wrote their MTP cache pages
        and send nothing back)."""
        if isinstance(prev_hidden, RankRows):  # each rank gathers the rows from its own copy
            prev_hidden = prev_hidden.kept
        return self.group.call("mtp_forward", batch, prev_hidden, depth, reuse, draft, rows)[0]


class GroupRunner(ModelRunner):
    """`ModelRunner` whose batches (built on the driver's host) run on the ranks."""

    def __init__(self, model: GroupModel):
        super().__init__(model, cache=None, backend=None, device="cpu")
        self.group = model.group

    def enable_decode_graphs(self, widths, max_batch_size, max_context, capture) -> None:
        """Every rank captures its own decode graphs (the same buckets, in the same order: their
        all-reduces are inside). Width 1 only: an MTP verify's drafts are made on the driver's side
        of the ranks (`workers.mtp_draft`), which has no graphs here."""
        if any(w != 1 for w in widths):
            raise ValueError(f"decode graphs of a tensor-parallel replica run width-1 steps only (no MTP), "
                             f"got widths {tuple(widths)}")
        self.group.call("enable_decode_graphs", tuple(widths), max_batch_size, max_context, capture)
        for w in widths:
            self.decode_graphs[w] = RankGraphs(DecodeGraphPlan.for_limits(w, max_batch_size, max_context), capture)

    def decode(self, step: DecodeStep, token_patch: TokenPatch | None = None):
        """A width-1 step: a `RankHidden` (run when sampled, one call per rank); wider steps (an MTP
        verify): every rank runs it now and rank 0's hidden ``[R * width, hidden]`` comes back."""
        if step.width == 1:
            return RankHidden(self.model, step, token_patch)
        return self.group.call("decode", step, host_patch(token_patch))[0]


@dataclass(frozen=True)
class RankGraphs:
    """The driver's record of the decode graphs its ranks captured (the engine reads the plan)."""

    plan: DecodeGraphPlan
    capture: bool

    def covers(self, num_requests: int, max_pages: int, width: int) -> bool:
        return self.plan.covers(num_requests, max_pages, width)
