"""Hidden states and sampled tokens that stay on the ranks of a tensor-parallel replica.

A prefill forward of ``T`` tokens leaves its normed hidden states ``[T, hidden]`` on every rank (the
same bytes everywhere after the all-reduces); the driver holds a `RankRows` handle to them instead of
the tensor. The engine needs few of those rows: the last row of each finished prompt (sampled on rank
0), the MTP layer's inputs (gathered by each rank from its own copy), a prompt's logprob rows (the
head on rank 0). Before this, the whole ``[T, hidden]`` came to the driver: 470 MB through Ray's object
store for an 8 x 4096 prefill at DeepSeek-V3.2 dims, which held tp 2 prefill at 0.23x tp 1
(docs/perf.md, session 17).

A handle is valid until the replica's next forward replaces what the ranks keep: a stale handle raises
(`KeptRows.check`), it never reads another forward's rows. Any torch operation on a handle fetches its
rows from rank 0 once (`RankRows.materialize`), so code written for tensors keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.model_runner import DecodeStep, TokenPatch


@dataclass(frozen=True)
class KeptRows:
    """Which rows of which forward's kept hidden states: what travels to the ranks.

    forward: the replica's forward counter at the forward that made them; rows: int64 ``[n]`` (host),
    or None for all of them."""

    forward: int
    rows: torch.Tensor | None

    def take(self, forward: int, hidden: torch.Tensor) -> torch.Tensor:
        """These rows of ``hidden``, the kept hidden states of forward number ``forward``."""
        if forward != self.forward:
            raise RuntimeError(f"rows of forward {self.forward} were asked for, but the ranks keep forward "
                               f"{forward}'s hidden states (a handle used after the next forward)")
        return hidden if self.rows is None else hidden.index_select(0, self.rows.to(hidden.device))


class _FetchedOnUse:
    """A value that lives on the ranks until used as a tensor: any tensor method or torch function
    applied to it runs on `materialize()` (fetched once by the subclass)."""

    def materialize(self) -> torch.Tensor:
        raise NotImplementedError

    def __getattr__(self, name: str):
        if name.startswith("_"):  # never for the object's own (possibly unset) fields
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return func(*_fetched(args), **_fetched(kwargs or {}))


class RankRows(_FetchedOnUse):
    """Rows ``[n, hidden]`` of the hidden states a forward left on the ranks of ``group``.

    ``index_select(0, ...)``, slicing and ``torch.cat`` of handles of one forward give handles (nothing
    moves); `GroupModel` passes a handle's `KeptRows` to the ranks; any other use fetches the rows."""

    def __init__(self, model, kept: KeptRows, num_rows: int, width: int, dtype: torch.dtype):
        self._model, self._kept = model, kept  # model: the `workers.rank_group.GroupModel` that ran the forward
        self.shape = torch.Size((num_rows, width))
        self.dtype = dtype
        self._host: torch.Tensor | None = None

    device = torch.device("cpu")  # where the driver builds what goes with the rows (indices, sampling inputs)

    @property
    def kept(self) -> KeptRows:
        """What to send to the ranks; raises here, on the driver, for a handle whose forward is no longer kept."""
        if self._model.forwards != self._kept.forward:
            raise RuntimeError(f"rows of forward {self._kept.forward} were asked for, but the ranks keep forward "
                               f"{self._model.forwards}'s hidden states (a handle used after the next forward)")
        return self._kept

    def __len__(self) -> int:
        return self.shape[0]

    def dim(self) -> int:
        return 2

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def _rows(self) -> torch.Tensor:
        return torch.arange(self.shape[0]) if self._kept.rows is None else self._kept.rows

    def _with_rows(self, rows: torch.Tensor) -> "RankRows":
        return RankRows(self._model, KeptRows(self._kept.forward, rows), len(rows), self.shape[1], self.dtype)

    def index_select(self, dim: int, index: torch.Tensor) -> "RankRows":
        if dim != 0:
            raise ValueError("hidden states kept on the ranks are selected by row (dim 0)")
        return self._with_rows(self._rows().index_select(0, index.cpu().long()))

    def __getitem__(self, key):
        if isinstance(key, slice):
            return self._with_rows(self._rows()[key])
        return self.materialize()[key]

    def materialize(self) -> torch.Tensor:
        """The rows on the host (fetched from rank 0 once; later uses reuse them)."""
        if self._host is None:
            self._host = self._model.group.call_rank(0, "kept_rows", self.kept)
        return self._host

    def clone(self) -> torch.Tensor:
        return self.materialize().clone()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.cat and not kwargs.get("dim") and len(args) == 1:  # rows of one forward: a handle
            parts = list(args[0])
            if parts and all(isinstance(p, RankRows) for p in parts) \
                    and len({(id(p._model), p._kept.forward) for p in parts}) == 1:
                return parts[0]._with_rows(torch.cat([p._rows() for p in parts]))
        return super().__torch_function__(func, types, args, kwargs)


def _fetched(value):
    """``value`` with every `RankRows` in it (nested in lists, tuples, dicts) replaced by its rows."""
    if isinstance(value, _FetchedOnUse):
        return value.materialize()
    if isinstance(value, (list, tuple)):
        return type(value)(_fetched(v) for v in value)
    if isinstance(value, dict):
        return {k: _fetched(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class SampledTokens:
    """Rows of the tokens rank 0 sampled in its decode step number ``call``: the input of the next step
    for the requests whose token is still in flight (`workers.model_runner.TokenPatch`). The ranks take
    them from rank 0's device (a broadcast), not from the driver, which has not read them yet.

    rows: int64 ``[m]`` (host), rows of that step's sampled tokens."""

    call: int
    rows: torch.Tensor


class _PendingTokens:
    """``SampleOutput.tokens`` of a step in flight: only selected (`SampledTokens`), never read."""

    device = torch.device("cpu")

    def __init__(self, call: int):
        self.call = call

    def index_select(self, dim: int, index: torch.Tensor) -> SampledTokens:
        if dim != 0:
            raise ValueError("sampled tokens are selected by row (dim 0)")
        return SampledTokens(self.call, index.cpu().long())


class PendingSample:
    """The ``SampleOutput`` of a decode step the ranks are running (`RankHidden.sample`): ``tokens``
    can be passed to the next step unread; ``packed()`` is read (``tolist()``, or any torch op) when
    the engine reads the step back, and only then does the driver wait for the ranks."""

    def __init__(self, group, refs: list, call: int):
        self._group, self._refs = group, refs
        self._out = None
        self.tokens = _PendingTokens(call)

    def result(self):
        """Rank 0's ``SampleOutput`` (host), waiting for the ranks the first time."""
        if self._out is None:
            self._out = self._group.results(self._refs)[0]
            self._refs = []
        return self._out

    def packed(self) -> "_PendingPacked":
        return _PendingPacked(self)


class _PendingPacked(_FetchedOnUse):
    """``SampleOutput.packed()`` of a step in flight: fetched on first use."""

    device = torch.device("cpu")  # the engine's read-back takes it as a host tensor (no device copy)

    def __init__(self, sample: PendingSample):
        self._sample = sample

    def materialize(self) -> torch.Tensor:
        return self._sample.result().packed()

    def tolist(self) -> list:
        return self.materialize().tolist()


def host_patch(patch: TokenPatch | None):
    """A token patch as it travels to the ranks: its rows a list, its tokens on the host, or the
    `SampledTokens` reference to rank 0's (those never leave the ranks)."""
    if patch is None or isinstance(patch[1], SampledTokens):
        return patch
    return list(patch[0]), patch[1].cpu()


@dataclass
class RankHidden:
    """The hidden states of a width-1 decode step that has not run yet: the engine only samples them
    (`workers.engine.Engine._decode` / ``_launch``), so the step runs when they are sampled, in the
    same call per rank (`RankWorker.decode_sample`), and the hidden states never leave rank 0's device.
    Sampled exactly once."""

    model: object  # workers.rank_group.GroupModel
    step: DecodeStep
    token_patch: TokenPatch | None  # its tokens: host int64, or `SampledTokens` of the step in flight
    sampled: bool = False

    @property
    def device(self) -> torch.device:
        """Where the sampler's inputs are built (the driver's host; rank 0 moves them)."""
        return torch.device("cpu")

    def sample(self, meta, history) -> PendingSample:
        """Start the step and its sampling on every rank; the result is read when the engine reads it."""
        if self.sampled:
            raise RuntimeError("a RankHidden is sampled once: its decode step runs with the sampling")
        self.sampled = True
        patch = host_patch(self.token_patch)
        self.model.decode_samples += 1
        call = self.model.decode_samples
        refs = self.model.group.submit("decode_sample", self.step, patch, meta, history, call)
        return PendingSample(self.model.group, refs, call)
