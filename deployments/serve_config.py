"""Offline check of a whole ``serve run`` config file (what ``dsa-pd check`` runs).

The file is the standard Serve schema (``applications: [{name,
route_prefix, import_path, args}]``), validated with Ray Serve's own
``ServeDeploySchema``; every application whose ``import_path`` is
``deployments.app:build_app`` then has its ``args`` checked end to end by
:func:`deployments.controller.check_args`. Nothing is started and no
weights are read.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pydantic

from deployments.admission import ingress_replicas, max_requests
from deployments.app_config import APP_IMPORT_PATH
from deployments.controller.v4_rules import v4_summary
from models.v4.config import V4Config
from deployments.controller import (
    CheckResult,
    Violation,
    check_args,
    estimate_memory,
    format_bytes,
    plan_placement,
    violations_from_pydantic,
)
from workers.prefix_cache import HOST_BYTES_PER_CACHED_PAGE

__all__ = ["AppReport", "ServeConfigReport", "check_serve_config", "format_report"]


@dataclass(frozen=True)
class AppReport:
    """One application of the file: its violations (paths relative to its ``args``) and check result."""

    index: int
    name: str
    route_prefix: str | None
    violations: tuple[Violation, ...]
    result: CheckResult | None

    @property
    def ok(self) -> bool:
        return not self.violations


@dataclass(frozen=True)
class ServeConfigReport:
    """Violations of the file structure (paths from the file root) and one report per application."""

    file_violations: tuple[Violation, ...]
    apps: tuple[AppReport, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.file_violations and all(a.ok for a in self.apps)


def _serve_schema_violations(doc: Any) -> list[Violation]:
    # Imported here: Ray takes seconds to import and only this check needs it.
    # Its pydantic-v1-style field declarations warn on import; not our users' concern.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from ray.serve.schema import ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(doc)
    except pydantic.ValidationError as e:
        return violations_from_pydantic(e)
    return []


def check_serve_config(doc: Any, gpu_memory_bytes: int | None = None) -> ServeConfigReport:
    """Check a parsed serve config YAML; see the module doc."""
    if not isinstance(doc, Mapping):
        return ServeConfigReport((Violation("(root)", f"a serve config is a mapping with 'applications', got {type(doc).__name__}"),))
    schema = _serve_schema_violations(doc)
    file_violations = [v for v in schema if not v.path.startswith("applications[")]
    apps_raw = doc.get("applications")
    if not isinstance(apps_raw, list) or not apps_raw:
        file_violations.append(Violation("applications", "a non-empty list of applications is required"))
        return ServeConfigReport(tuple(file_violations))
    # Ray's per-application errors are reported under their application.
    app_schema = [v for v in schema if v.path.startswith("applications[")]
    reports = []
    for i, app in enumerate(apps_raw):
        prefix = f"applications[{i}]"
        own = [Violation(v.path[len(prefix) + 1:] or "(app)", v.message) for v in app_schema
               if v.path == prefix or v.path.startswith(prefix + ".")]
        if not isinstance(app, Mapping):
            reports.append(AppReport(i, f"#{i}", None, tuple(own) or (Violation("(app)", "must be a mapping"),), None))
            continue
        name = str(app.get("name", f"#{i}"))
        import_path = app.get("import_path")
        result = None
        if import_path != APP_IMPORT_PATH:
            if not any(v.path == "import_path" for v in own):
                own.append(Violation("import_path", f"expected {APP_IMPORT_PATH!r}, got {import_path!r}"))
        else:
            args = app.get("args") or {}
            if not isinstance(args, Mapping):
                own.append(Violation("args", f"must be a mapping, got {type(args).__name__}"))
            else:
                result = check_args(args, gpu_memory_bytes)
                own += [Violation(f"args.{v.path}", v.message) for v in result.violations]
        reports.append(AppReport(i, name, app.get("route_prefix"), tuple(own), result))
    return ServeConfigReport(tuple(file_violations), tuple(reports))


def _summary(result: CheckResult, gpu_memory_bytes: int | None) -> list[str]:
    app_cfg, m = result.app_cfg, result.model_cfg
    assert app_cfg is not None and m is not None
    plan = plan_placement(app_cfg)
    if isinstance(m, V4Config):
        return _v4_summary(app_cfg, m, plan, gpu_memory_bytes)
    plan_ = m.topk_plan
    lines = [
        f"model {app_cfg.model_name!r}: {m.arch}, {m.num_hidden_layers} layers + {m.num_nextn_predict_layers} MTP, "
        f"{m.num_attention_heads} heads, top-k computed in {sum(plan_.computes[:plan_.num_layers])} of "
        f"{plan_.num_layers} layers, weights {'fp8' if m.is_fp8 else 'bf16'}",
    ]
    if app_cfg.monolithic:
        lines.append(f"mode monolithic: decode replicas only, each prefilling its own requests (chunk_size "
                     f"{app_cfg.decode.chunk_size}); no prefill role, no NIXL (transfer settings ignored)")
    for role in app_cfg.roles:
        role_cfg, place = app_cfg.for_role(role), plan.for_role(role)
        lo, hi = place.replica_range
        reps = f"{lo}" if lo == hi else f"{lo}-{hi}"
        pg = f", {place.placement_group_strategy} x {len(place.placement_group_bundles)} bundles" if place.placement_group_bundles else ""
        line = (f"{role}: {reps} replica(s) x tp {role_cfg.tensor_parallel_size} ({place.gpus_per_replica:g} GPU each{pg}), "
                f"{role_cfg.backend}/{role_cfg.device}/{role_cfg.dtype}, kv {role_cfg.kv_cache_dtype}, MTP drafts {role_cfg.mtp_draft_tokens}")
        lines.append(line)
        if role_cfg.device == "cuda":
            lines.append(f"  per GPU: {estimate_memory(role_cfg, m, gpu_memory_bytes).describe()}")
        else:
            est = estimate_memory(role_cfg, m, gpu_memory_bytes)
            lines.append(f"  per replica (host memory): weights {format_bytes(est.weights_bytes)} + pages "
                         f"{format_bytes(est.page_bytes)}")
        lines.append("  " + _prefix_cache_line(app_cfg, role_cfg))
    lines.append(_ingress_line(app_cfg))
    lo, hi = plan.gpus
    lines.append(f"GPUs: {lo:g}" + ("" if lo == hi else f" to {hi:g}"))
    return lines


def _ingress_line(app_cfg) -> str:
    n = ingress_replicas(app_cfg)
    how = "ingress.num_replicas" if app_cfg.ingress.num_replicas is not None else "default: 1 per 32 decode streams"
    return f"ingress: {n} replica(s) ({how}), each holding up to {max_requests(app_cfg)} requests"


def _v4_summary(app_cfg, m: V4Config, plan, gpu_memory_bytes: int | None) -> list[str]:
    kinds = {k: m.layer_types.count(k) for k in dict.fromkeys(m.layer_types)}
    lines = [f"model {app_cfg.model_name!r}: {m.arch}, {m.num_hidden_layers} layers "
             f"({', '.join(f'{n} {k}' for k, n in kinds.items())}), window {m.sliding_window}, compress rates "
             f"{dict(m.compress_rates)}, {m.num_attention_heads} heads, {m.num_nextn_predict_layers} MTP "
             "(sliding-window block)"]
    for role in app_cfg.roles:
        role_cfg, place = app_cfg.for_role(role), plan.for_role(role)
        lo, hi = place.replica_range
        lines.append(f"{role}: {lo if lo == hi else f'{lo}-{hi}'} replica(s), {role_cfg.backend}/{role_cfg.device}/"
                     f"{role_cfg.dtype}, kv {role_cfg.kv_cache_dtype}, MTP drafts {role_cfg.mtp_draft_tokens}")
        lines.append(f"  {v4_summary(role_cfg, m, gpu_memory_bytes)}")
        lines.append("  " + _prefix_cache_line(app_cfg, role_cfg, v4=True))
    lines.append(_ingress_line(app_cfg))
    return lines


def _prefix_cache_line(app_cfg, role_cfg, v4: bool = False) -> str:
    """How `features.prefix_caching` uses the role's pool: no memory of its own (cached pages are pool pages,
    unreferenced ones counted free), a host-side index of at most every page. ``v4``: DeepSeek-V4's cache
    groups (`workers.v4_prefix`: reused up to 256-token cuts, each cut's CSA state in a page of its own)."""
    if not app_cfg.features.prefix_caching:
        return "prefix cache: off (every prompt is prefilled and pushed whole)"
    if v4:
        return ("prefix cache: on, in each group's pool pages, reused up to cuts every 256 tokens (the CSA state "
                "groups hold a page per cut of every sequence); unreferenced cached pages count as free")
    index = format_bytes(role_cfg.num_pages * HOST_BYTES_PER_CACHED_PAGE)
    route = (f"routed cache_aware (overlap weight {app_cfg.router.overlap_weight:g} requests per page, "
             f"{app_cfg.router.prefix_pages} pages looked up)" if app_cfg.router.policy == "cache_aware"
             else f"routed {app_cfg.router.policy} (the cache is not looked at)")
    return (f"prefix cache: on, in the {role_cfg.num_pages} pool pages (no memory of its own; unreferenced cached "
            f"pages count as free), host index up to {index}; {route}")


def format_report(source: str, report: ServeConfigReport, gpu_memory_bytes: int | None = None) -> str:
    """Human-readable report: every violation with its path, or a summary of each valid application."""
    out = []
    for v in report.file_violations:
        out.append(f"{source}: {v}")
    for app in report.apps:
        head = f"{source}: application {app.name!r} (applications[{app.index}])"
        if app.ok:
            out.append(f"{head}: OK")
            if app.result is not None:
                out += [f"  {line}" for line in _summary(app.result, gpu_memory_bytes)]
        else:
            out.append(f"{head}: {len(app.violations)} violation(s)")
            out += [f"  {v}" for v in app.violations]
    return "\n".join(out)
