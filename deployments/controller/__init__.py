"""The controller: validates a whole application config before anything is placed.

``validate(app_cfg, model_cfg)`` applies the rules of DESIGN.md ("Controller
rules") and returns *every* violation, each with the path of the field to
change (``decode.tensor_parallel_size``) and a message saying what is wrong
and why. ``check_or_raise`` turns a non-empty list into one
``AppConfigError``. ``check_args`` runs the whole offline check on a raw
``args`` mapping: pydantic field validation, model-config resolution, then
the rules — what ``dsa-pd check`` and the app builder call.

``plan_placement(app_cfg)`` computes the Ray resources of every replica
(placement-group bundles for tensor-parallel replicas); it is pure
computation, no Ray import.

In monolithic mode (``AppConfig.mode``) only the decode role is deployed:
the rules, the placement and the memory plan cover it alone, the
prefill/decode agreement rules do not apply, and a ``prefill`` section is a
violation (it would configure nothing).

One module per job:

- `violations`: `Violation`, `AppConfigError`, pydantic's field errors as violations;
- `memory`: cache page geometry and the memory plan of a role (`estimate_memory`);
- `rules`: the rules (`validate`, `check_or_raise`) and the whole offline check (`check_args`);
- `placement`: the Ray resources of every replica (`plan_placement`).
"""

from deployments.app_config import APP_IMPORT_PATH
from deployments.controller.memory import (
    GiB,
    MemoryEstimate,
    bytes_per_page,
    cache_formats,
    estimate_memory,
    format_bytes,
    model_param_count,
    role_compat_info,
    weight_bytes_per_rank,
)
from deployments.controller.placement import PlacementPlan, RolePlacement, plan_placement
from deployments.controller.rules import (
    FLASH_MLA_HEADS,
    CheckResult,
    check_args,
    check_or_raise,
    resolve_model_config,
    validate,
)
from deployments.controller.violations import AppConfigError, Violation, violations_from_pydantic

__all__ = [
    "APP_IMPORT_PATH",
    "AppConfigError",
    "CheckResult",
    "FLASH_MLA_HEADS",
    "GiB",
    "MemoryEstimate",
    "PlacementPlan",
    "RolePlacement",
    "Violation",
    "cache_formats",
    "check_args",
    "check_or_raise",
    "bytes_per_page",
    "estimate_memory",
    "format_bytes",
    "model_param_count",
    "plan_placement",
    "role_compat_info",
    "resolve_model_config",
    "validate",
    "violations_from_pydantic",
    "weight_bytes_per_rank",
]
