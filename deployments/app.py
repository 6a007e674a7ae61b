"""``deployments.app:build_app``: the Ray Serve application (the ``import_path`` of every config).

Order of work: validate the whole config with the controller (every
violation at once; nothing is placed when one exists), make the tiny model
on first start, then build the graph with the placement plan's options:

    OpenAIIngress --(DecodeRouter)--> DecodeServer --(PrefillRouter)--> PrefillServer
           \\                              |                               |
            `-------------- PeerDirectory <-------------------------------'

In monolithic mode (``mode: monolithic``) there is no prefill deployment:
the ingress, the directory (behind ``/health`` and ``/stats``) and decode
replicas that prefill their own requests, without NIXL.

`serve run configs/tiny_pd.yaml` calls this in Serve's build task; a
violation raises `AppConfigError` (as `InvalidAppConfig`, which Serve does
not retry), whose message lists every violation with its path, and the
application goes to DEPLOY_FAILED with that message without starting a
replica. (`dsa-pd check` runs the same validation without a cluster.)
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve
from ray.serve.config import BackpressureConfig, RequestRouterConfig
from ray.serve.exceptions import RayServeException

from deployments.app_config import AppConfig
from deployments.controller import AppConfigError, check_args, plan_placement

log = logging.getLogger("ray.serve")


class InvalidAppConfig(AppConfigError, RayServeException):
    """`AppConfigError` from the build task. Serve retries a build that raises anything else three
    times (a transient import failure may pass), each attempt a new worker process that imports
    and validates again (~5 s apiece on 2 cores); a violation is the same every time, and a
    `RayServeException` fails the build at once with this message."""


def _router_config(router_cls: type, cfg: AppConfig, role: str) -> RequestRouterConfig:
    from deployments.router import ROUTING_STATS_PERIOD_S

    return RequestRouterConfig(
        request_router_class=router_cls,
        request_router_kwargs={"policy": cfg.router.policy, "model": cfg.model_name,
                               "overlap_weight": cfg.router.overlap_weight},
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        request_routing_stats_timeout_s=10 * ROUTING_STATS_PERIOD_S,
    )


def build_app(args: dict[str, Any] | AppConfig) -> serve.Application:
    """Validate ``args`` (an `AppConfig` mapping), make the model if it is a tiny spec, and build the app."""
    result = check_args(args)
    if result.violations:
        raise InvalidAppConfig(list(result.violations))
    cfg = result.app_cfg
    assert cfg is not None

    # Imported after validation: a bad config fails fast without loading torch-heavy modules.
    from deployments.admission import ingress_replicas, max_requests
    from deployments.decode_server import DecodeServer
    from deployments.ingress import OpenAIIngress
    from deployments.peer_directory import PeerDirectory
    from deployments.prefill_server import PrefillServer
    from deployments.router import DecodeRouter, PrefillRouter

    model_dir = str(cfg.model.checkpoint_dir(make=True))
    log.info("serving %s from %s (%s mode)", cfg.model_name, model_dir, cfg.mode)
    plan = plan_placement(cfg)
    # Monolithic: no prefill section reaches the replicas (there is none to configure).
    app_args = cfg.model_dump(mode="json", exclude={"prefill"} if cfg.monolithic else None)

    directory = serve.deployment(PeerDirectory).options(
        name="PeerDirectory", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=1000,
        # Every replica heartbeats twice a second: access logs would drown the rest.
        logging_config={"enable_access_log": False},
    ).bind(ttl_s=cfg.transfer.peer_ttl_s)
    prefill = None
    if not cfg.monolithic:
        prefill = serve.deployment(PrefillServer).options(
            name="PrefillServer", request_router_config=_router_config(PrefillRouter, cfg, "prefill"),
            **plan.for_role("prefill").deployment_options(),
        ).bind(app_args, model_dir, directory)
    decode = serve.deployment(DecodeServer).options(
        name="DecodeServer", request_router_config=_router_config(DecodeRouter, cfg, "decode"),
        **plan.decode.deployment_options(),
    ).bind(app_args, model_dir, directory, prefill)
    lo, hi = plan.decode.replica_range
    # Enough for every decode slot plus requests waiting on the routers; past limits.max_requests the
    # handler answers 429 itself (deployments/admission.py).
    ingress_ongoing = max(256, 2 * hi * plan.decode.max_ongoing_requests, max_requests(cfg) + 64)
    ingress = serve.deployment(OpenAIIngress).options(
        name="OpenAIIngress", num_replicas=ingress_replicas(cfg), ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=ingress_ongoing,
        # The proxy's queue in front of the ingress, bounded too: a flood the handlers cannot even
        # answer 429 to fast enough is refused by Serve's proxy (429 + Retry-After, its own body).
        max_queued_requests=ingress_ongoing,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=cfg.limits.retry_after_s),
    ).bind(app_args, model_dir, decode, directory)
    return ingress
