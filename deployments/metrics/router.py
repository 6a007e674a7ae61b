"""Routing decisions of the request routers (`RouterMetrics`).

Serve runs a deployment's router in the process that holds its handle: the
decode router in the ingress, the prefill router in every decode replica.
The series therefore carry that process's Serve tags (deployment
``OpenAIIngress`` or ``DecodeServer``) and name the routed-to deployment in
``target``.
"""

from __future__ import annotations

from typing import Callable

from deployments.metrics.series import Series, never_raises

_OUTCOMES_OF = {"round_robin": ("round_robin", "no_replica")}
_OUTCOMES_OF = {**_OUTCOMES_OF, "least_loaded": ("least_loaded", "no_replica")}
_LOAD_OUTCOMES = ("least_loaded", "prefix_cache", "no_replica")


class RouterMetrics:
    """Decisions of one router (``target``: the deployment it routes to) running ``policy``."""

    def __init__(self, model: str, target: str, policy: str):
        self.policy = policy
        self.decisions = Series("dsa_pd_router_decisions", {"model": model, "target": target, "policy": policy})
        for outcome in _OUTCOMES_OF.get(policy, _LOAD_OUTCOMES):
            self.decisions.zero(outcome=outcome)

    @never_raises
    def decided(self, outcome: Callable[[], str]) -> None:
        """One ranking made; ``outcome()`` classifies it (`deployments.metrics.table.ROUTER_OUTCOMES`)."""
        self.decisions.inc(outcome=outcome())
