"""The Ray resources of every replica (`plan_placement`): placement-group bundles for
tensor-parallel replicas. Pure computation, no Ray import."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deployments.app_config import AppConfig, RoleConfig

from deployments.controller.memory import Role


@dataclass(frozen=True)
class RolePlacement:
    """Ray resources of one role's replicas.

    With one rank, the rank runs inside the Serve replica: ``ray_actor_options``
    carries its CPUs and (possibly fractional) GPUs and there is no placement
    group. With ``tp`` ranks, each replica reserves a placement group of
    ``tp`` bundles ``{"CPU": num_cpus, "GPU": 1}`` packed on one node
    (``STRICT_PACK``: NCCL and the per-rank NIXL agents stay on NVLink); Serve
    puts the replica actor in bundle 0 with no resources of its own (it only
    orchestrates), and rank worker ``r`` goes into bundle ``r`` with
    ``rank_actor_options``.
    """

    role: Role
    num_replicas: int | None
    autoscaling_config: dict[str, float | int] | None
    ray_actor_options: dict[str, float]
    placement_group_bundles: tuple[dict[str, float], ...] | None
    placement_group_strategy: str | None
    rank_actor_options: dict[str, float] | None
    rank_bundle_indices: tuple[int, ...]
    max_ongoing_requests: int

    @property
    def gpus_per_replica(self) -> float:
        if self.placement_group_bundles is not None:
            return sum(b.get("GPU", 0.0) for b in self.placement_group_bundles)
        return self.ray_actor_options.get("num_gpus", 0.0)

    @property
    def replica_range(self) -> tuple[int, int]:
        """``(min, max)`` replicas."""
        if self.autoscaling_config is not None:
            return int(self.autoscaling_config["min_replicas"]), int(self.autoscaling_config["max_replicas"])
        n = self.num_replicas or 1
        return n, n

    def deployment_options(self) -> dict[str, Any]:
        """Keyword arguments for ``serve.deployment(...).options(...)``."""
        opts: dict[str, Any] = {
            "ray_actor_options": dict(self.ray_actor_options),
            "max_ongoing_requests": self.max_ongoing_requests,
        }
        if self.autoscaling_config is not None:
            opts["autoscaling_config"] = dict(self.autoscaling_config)
        else:
            opts["num_replicas"] = self.num_replicas
        if self.placement_group_bundles is not None:
            opts["placement_group_bundles"] = [dict(b) for b in self.placement_group_bundles]
            opts["placement_group_strategy"] = self.placement_group_strategy
        return opts


@dataclass(frozen=True)
class PlacementPlan:
    """Placement of the deployed roles (``prefill`` None in monolithic mode); ``gpus`` is the
    (min, max) GPU total over the replica range."""

    prefill: RolePlacement | None
    decode: RolePlacement

    @property
    def placements(self) -> tuple[RolePlacement, ...]:
        """The placements of the deployed roles, prefill first."""
        return tuple(p for p in (self.prefill, self.decode) if p is not None)

    def for_role(self, role: str) -> RolePlacement:
        place = {"prefill": self.prefill, "decode": self.decode}[role]
        if place is None:
            raise ValueError(f"no {role} role is deployed in monolithic mode")
        return place

    @property
    def gpus(self) -> tuple[float, float]:
        lo = sum(p.gpus_per_replica * p.replica_range[0] for p in self.placements)
        hi = sum(p.gpus_per_replica * p.replica_range[1] for p in self.placements)
        return lo, hi


def _plan_pool(role: Role, role_cfg: RoleConfig) -> RolePlacement:
    tp = role_cfg.tensor_parallel_size
    gpu_per_rank = 1.0 if role_cfg.device == "cuda" else 0.0
    autoscaling = None
    if role_cfg.autoscaling is not None:
        a = role_cfg.autoscaling
        autoscaling = {
            "min_replicas": a.min_replicas,
            "max_replicas": a.max_replicas,
            "target_ongoing_requests": a.target_ongoing_requests or float(role_cfg.max_batch_size),
        }
    common = dict(
        role=role,
        num_replicas=None if autoscaling else (role_cfg.num_replicas or 1),
        autoscaling_config=autoscaling,
        max_ongoing_requests=role_cfg.ongoing_requests_cap,
    )
    if tp == 1:
        return RolePlacement(
            ray_actor_options={"num_cpus": float(role_cfg.num_cpus), "num_gpus": float(role_cfg.num_gpus)},
            placement_group_bundles=None,
            placement_group_strategy=None,
            rank_actor_options=None,
            rank_bundle_indices=(),
            **common,
        )
    bundle = {"CPU": float(role_cfg.num_cpus)}
    if gpu_per_rank:
        bundle["GPU"] = gpu_per_rank
    return RolePlacement(
        ray_actor_options={"num_cpus": 0.0, "num_gpus": 0.0},
        placement_group_bundles=tuple(dict(bundle) for _ in range(tp)),
        placement_group_strategy="STRICT_PACK",
        rank_actor_options={"num_cpus": float(role_cfg.num_cpus), "num_gpus": gpu_per_rank},
        rank_bundle_indices=tuple(range(tp)),
        **common,
    )


def plan_placement(app_cfg: AppConfig) -> PlacementPlan:
    """Ray resources per replica of the deployed roles (pure computation; run ``validate`` first)."""
    prefill = None if app_cfg.monolithic else _plan_pool("prefill", app_cfg.prefill)
    return PlacementPlan(prefill=prefill, decode=_plan_pool("decode", app_cfg.decode))
