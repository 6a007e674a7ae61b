"""The Grafana dashboards of dsa-pd, generated from the metrics table.

Four dashboards, one JSON file each in ``helm/dsa-pd/dashboards/`` (the
chart ships each as a ConfigMap for Grafana's sidecar): ``overview``
(requests, errors, end-to-end latency, tokens/s per role), ``prefill``
(chunk time, queue, pages, push throughput), ``decode`` (batch, step time,
pages, MTP acceptance) and ``transfer`` (KV bytes/s, push time, failures).
Each is templated on a Prometheus data source, ``model`` and ``replica``.

Panels are declared below as plain data (`Panel`, `Target`); every series
name comes from `deployments.metrics.table` (`prom`), so a dashboard cannot
ask for a metric no component exports. grafana-foundation-sdk (a dev
dependency) turns them into dashboard JSON.

    python -m deployments.metrics.dashboards           # write the JSON files
    python -m deployments.metrics.dashboards --check   # exit 1 if the files differ from the code

Ingress and router series carry the ingress's (or the decode replica's)
``replica`` label, not a prefill or decode replica's, so only the model
variable filters them; per-replica series take both.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from deployments.metrics.table import prom

REPO = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = REPO / "helm" / "dsa-pd" / "dashboards"
RATE = "$__rate_interval"
"""Grafana's rate window: at least four scrape intervals of the data source."""
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel and its series' legend."""

    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    """A time-series panel; ``width`` in Grafana's 24 columns."""

    title: str
    description: str
    unit: str
    targets: tuple[Target, ...]
    width: int = 12


@dataclass(frozen=True)
class Board:
    """A dashboard: rows of panels; ``role`` scopes its replica variable (None: every replica)."""

    name: str
    title: str
    description: str
    role: str | None
    rows: tuple[tuple[str, tuple[Panel, ...]], ...]

    @property
    def uid(self) -> str:
        return f"dsa-pd-{self.name}"

    def panels(self) -> list[Panel]:
        return [p for _, panels in self.rows for p in panels]


# ---------------------------------------------------------------- PromQL helpers
def sel(replica: bool = True, **matchers: str) -> str:
    """A label selector on the dashboard variables (``replica=False``: ingress and router series) plus
    ``matchers`` (a value starting with ``!`` or ``~`` becomes ``!=`` / ``=~``)."""
    parts = ['model=~"$model"'] + (['replica=~"$replica"'] if replica else [])
    for k, v in matchers.items():
        op = {"!": "!=", "~": "=~"}.get(v[:1], "=")
        parts.append(f'{k}{op}"{v.lstrip("!~") if op != "=" else v}"')
    return "{" + ",".join(parts) + "}"


def rate(name: str, by: tuple[str, ...] = (), replica: bool = True, **matchers: str) -> str:
    """``sum by (by) (rate(<name's series>{selector}[$__rate_interval]))``."""
    inner = f"rate({prom(name)}{sel(replica, **matchers)}[{RATE}])"
    return f"sum by ({', '.join(by)}) ({inner})" if by else f"sum({inner})"


def gauge(name: str, by: tuple[str, ...] = ("replica",), **matchers: str) -> str:
    """``sum by (by) (<gauge>{selector})``."""
    return f"sum by ({', '.join(by)}) ({prom(name)}{sel(True, **matchers)})"


def ratio(num: str, den: str) -> str:
    """``num / den`` that reads 0, not NaN, while ``den`` is 0 (an idle window or a feature that is off)."""
    return f"({num}) / clamp_min({den}, 1e-9)"


def quantiles(name: str, by: tuple[str, ...] = (), replica: bool = True, legend: str = "",
              **matchers: str) -> tuple[Target, ...]:
    """p50 / p90 / p99 of the histogram ``name`` (its ``_bucket`` series) over the rate window."""
    inner = f"rate({prom(name)}_bucket{sel(replica, **matchers)}[{RATE}])"
    keys = ", ".join(("le",) + by)
    prefix = legend + " " if legend else ""
    return tuple(Target(f"histogram_quantile({q}, sum by ({keys}) ({inner}))", f"{prefix}p{round(q * 100)}")
                 for q in QUANTILES)


def _p(title: str, description: str, unit: str, *targets: Target, width: int = 12) -> Panel:
    return Panel(title, description, unit, tuple(targets), width)


# ---------------------------------------------------------------- the dashboards
def overview() -> Board:
    requests = (
        _p("Requests/s by outcome", "Requests the ingress answered, by outcome: stop / length (finished), error, "
           "cancelled (the client left).", "reqps",
           Target(rate("dsa_pd_requests", ("outcome",), replica=False), "{{outcome}}")),
        _p("Errors/s by type", "Requests answered with an OpenAI error, by its code or type (0 when none).", "reqps",
           Target(rate("dsa_pd_requests", ("error_type",), replica=False, outcome="error"), "{{error_type}}")),
        _p("Time to first token (end to end)", "From arrival at the ingress to the first token there: "
           "tokenization, routing, queueing, the prefill hop and the KV push included.", "s",
           *quantiles("dsa_pd_request_ttft_seconds", replica=False)),
        _p("Time per output token", "Per request: (last token - first token) / (tokens - 1), at the ingress.", "s",
           *quantiles("dsa_pd_request_tpot_seconds", replica=False)),
        _p("Inter-token latency", "Gaps between consecutive outputs of a request at the ingress.", "s",
           *quantiles("dsa_pd_request_itl_seconds", replica=False)),
        _p("End-to-end latency", "Arrival at the ingress to the last token, finished requests.", "s",
           *quantiles("dsa_pd_request_e2e_seconds", replica=False)),
    )
    tokens = (
        _p("Prompt tokens/s per role", "Prefill: prompt tokens computed (per chunk). Decode: prompt tokens taken in "
           "(KV landed, or prefilled locally in monolithic mode).", "short",
           Target(rate("dsa_pd_prompt_tokens", ("role",)), "{{role}}")),
        _p("Generated tokens/s per role", "Decode: tokens streamed to clients. Prefill: token 1 of each prompt "
           "(which decode streams too).", "short",
           Target(rate("dsa_pd_generated_tokens", ("role",)), "{{role}}")),
        _p("Prompt and generation length", "Median tokens per request (ingress).", "short",
           Target(f"histogram_quantile(0.5, sum by (le) (rate({prom('dsa_pd_request_prompt_tokens')}_bucket"
                  f"{sel(False)}[{RATE}])))", "prompt p50"),
           Target(f"histogram_quantile(0.5, sum by (le) (rate({prom('dsa_pd_request_generation_tokens')}_bucket"
                  f"{sel(False)}[{RATE}])))", "generation p50")),
        _p("Time to first token: ingress vs decode", "p90 end to end (ingress) and from the decode replica's "
           "acceptance: the gap is the ingress, routing and decode queueing before it.", "s",
           Target(quantiles("dsa_pd_request_ttft_seconds", replica=False)[1].expr, "ingress p90"),
           Target(quantiles("dsa_pd_decode_ttft_seconds")[1].expr, "decode p90")),
    )
    health = (
        _p("Routing decisions/s", "Rankings by the request routers, by target deployment and outcome.", "ops",
           Target(rate("dsa_pd_router_decisions", ("target", "outcome"), replica=False), "{{target}} {{outcome}}")),
        _p("Rejections, retries and preemptions/s", "Requests refused by a replica, requests whose prefill a "
           "decode replica sent again (its prefill replica died), and running requests preempted, by role and "
           "reason.", "ops",
           Target(rate("dsa_pd_rejections", ("role", "reason")), "rejected {{role}} {{reason}}"),
           Target(rate("dsa_pd_retries", ("role", "reason")), "retried {{role}} {{reason}}"),
           Target(rate("dsa_pd_preemptions", ("role", "reason")), "preempted {{role}} {{reason}}")),
        _p("Prefix cache hit rate", "Prompt tokens found in the replicas' prefix caches / prompt tokens looked up, "
           "per role (not computed again; on decode, not pushed again).", "percentunit",
           Target(ratio(rate("dsa_pd_prefix_cache_hits", ("role",)), rate("dsa_pd_prefix_cache_queries", ("role",))),
                  "{{role}}")),
        _p("Prefix cache pages and evictions", "Pages the prefix caches hold (shared or reclaimable), and cached "
           "pages evicted per second, per role.", "short",
           Target(gauge("dsa_pd_prefix_cache_pages", ("role",)), "cached {{role}}"),
           Target(rate("dsa_pd_prefix_cache_evictions", ("role",)), "evicted/s {{role}}")),
    )
    return Board("overview", "dsa-pd / Overview", "Requests, latency and tokens/s per role of a dsa-pd deployment.",
                 None, (("Requests", requests), ("Tokens", tokens), ("Routing and capacity", health)))


def prefill() -> Board:
    r = {"role": "prefill"}
    work = (
        _p("Prompt tokens/s per replica", "Prompt tokens computed by each prefill replica.", "short",
           Target(rate("dsa_pd_prompt_tokens", ("replica",), **r), "{{replica}}")),
        _p("Chunk time", "Wall time of a prefill step (one forward over up to chunk_size tokens, its sampling and "
           "the push it posts).", "s", *quantiles("dsa_pd_engine_step_seconds", **r, kind="prefill")),
        _p("Queue and running", "Tasks waiting for pages, and tasks being prefilled.", "short",
           Target(gauge("dsa_pd_queue_depth", **r), "queued {{replica}}"),
           Target(gauge("dsa_pd_running_requests", **r), "running {{replica}}")),
        _p("Pages used / total", "The page pool of each prefill replica.", "short",
           Target(gauge("dsa_pd_pages_used", **r), "used {{replica}}"),
           Target(gauge("dsa_pd_pages_total", **r), "total {{replica}}")),
    )
    push = (
        _p("KV push throughput", "Bytes of completed pushes per second, per prefill replica.", "Bps",
           Target(rate("dsa_pd_kv_push_bytes", ("replica",)), "{{replica}}")),
        _p("Push tail time", "Transfer after a prompt's last forward (what the first token waits for).", "s",
           *quantiles("dsa_pd_kv_push_tail_seconds")),
        _p("Rejections/s", "Tasks refused by prefill replicas, by reason.", "ops",
           Target(rate("dsa_pd_rejections", ("reason",), **r), "{{reason}}")),
    )
    return Board("prefill", "dsa-pd / Prefill", "Prefill replicas: chunked prefill, queues, pages and pushes.",
                 "prefill", (("Prefill", work), ("Push", push)))


def decode() -> Board:
    r = {"role": "decode"}
    batch = (
        _p("Generated tokens/s per replica", "Tokens each decode replica streamed.", "short",
           Target(rate("dsa_pd_generated_tokens", ("replica",), **r), "{{replica}}")),
        _p("Running batch and queue", "Requests in the decode batch (or prefilling), and waiting (for pages, KV or "
           "a slot).", "short",
           Target(gauge("dsa_pd_running_requests", **r), "running {{replica}}"),
           Target(gauge("dsa_pd_queue_depth", **r), "queued {{replica}}")),
        _p("Step time by kind", "Wall time of an engine step: decode (one token per request), verify (MTP draft + "
           "verify), prefill (a chunk: monolithic mode or a re-prefill).", "s",
           *quantiles("dsa_pd_engine_step_seconds", ("kind",), legend="{{kind}}", **r)),
        _p("Pages used / total", "The page pool of each decode replica.", "short",
           Target(gauge("dsa_pd_pages_used", **r), "used {{replica}}"),
           Target(gauge("dsa_pd_pages_total", **r), "total {{replica}}")),
        _p("Decode-side time to first token", "From the decode replica accepting a request to its first token "
           "(pages, the prefill call and the KV push included).", "s", *quantiles("dsa_pd_decode_ttft_seconds")),
        _p("Preemptions/s", "Running requests preempted for lack of pages.", "ops",
           Target(rate("dsa_pd_preemptions", ("replica",), **r), "{{replica}}")),
    )
    mtp = (
        _p("MTP draft and accepted tokens/s", "Draft tokens proposed and accepted (0 without MTP).", "short",
           Target(rate("dsa_pd_mtp_draft_tokens", ("replica",)), "drafted {{replica}}"),
           Target(rate("dsa_pd_mtp_accepted_tokens", ("replica",)), "accepted {{replica}}")),
        _p("MTP acceptance rate", "Accepted / drafted tokens over the window (0 without drafts).", "percentunit",
           Target(ratio(rate("dsa_pd_mtp_accepted_tokens", ("replica",)),
                        rate("dsa_pd_mtp_draft_tokens", ("replica",))), "{{replica}}")),
        _p("MTP accepted length", "Verify steps per second by how many drafts a request had accepted.", "ops",
           Target(rate("dsa_pd_mtp_accepted_length", ("length",)), "{{length}} accepted"), width=24),
    )
    return Board("decode", "dsa-pd / Decode", "Decode replicas: batch, step time, pages and MTP acceptance.",
                 "decode", (("Decode", batch), ("MTP", mtp)))


def transfer() -> Board:
    panels = (
        _p("KV bytes/s", "Bytes of KV, indexer and state pages written prefill -> decode by completed pushes.", "Bps",
           Target(rate("dsa_pd_kv_push_bytes", ("replica",)), "{{replica}}")),
        _p("Pushes/s by status", "Pushes that ended: done, failed, expired.", "ops",
           Target(rate("dsa_pd_kv_pushes", ("status",)), "{{status}}")),
        _p("Push time", "A whole push, from the task's admission to its last WRITE (spans the prompt's chunks).",
           "s", *quantiles("dsa_pd_kv_push_seconds")),
        _p("Push tail time", "From posting the last chunk to the end of the push.", "s",
           *quantiles("dsa_pd_kv_push_tail_seconds")),
        _p("Push failures/s", "Pushes that failed or expired (0 when none).", "ops",
           Target(rate("dsa_pd_kv_pushes", ("status",), status="!done"), "{{status}}")),
        _p("Bytes per push", "Mean bytes of a completed push (from counters: exact, unlike a histogram's _sum, "
           "which Ray 2.60 exports as bucket midpoints).", "decbytes",
           Target(ratio(rate("dsa_pd_kv_push_bytes"), rate("dsa_pd_kv_pushes", status="done")), "bytes per push")),
    )
    return Board("transfer", "dsa-pd / KV transfer", "KV page pushes prefill -> decode over NIXL.", "prefill",
                 (("Transfer", panels),))


BOARDS = (overview, prefill, decode, transfer)


# ---------------------------------------------------------------- JSON
def build(board: Board) -> dict:
    """The Grafana dashboard JSON of ``board`` (grafana-foundation-sdk builders)."""
    from grafana_foundation_sdk.builders import common as cb
    from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, QueryVariable, Row
    from grafana_foundation_sdk.builders.prometheus import Dataquery
    from grafana_foundation_sdk.builders.timeseries import Panel as TimeSeries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, TooltipDisplayMode
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh, VariableSort

    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    role = f',role="{board.role}"' if board.role else ""
    d = (Dashboard(board.title).uid(board.uid).description(board.description).tags(["dsa-pd"])
         .refresh("30s").time("now-1h", "now").timezone("browser").editable()
         .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
         .with_variable(QueryVariable("model").label("Model").datasource(ds)
                        .query(f"label_values({prom('dsa_pd_pages_total')}, model)")
                        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
                        .multi(True).include_all(True).all_value(".*"))
         .with_variable(QueryVariable("replica").label("Replica").datasource(ds)
                        .query(f'label_values({prom("dsa_pd_pages_total")}{{model=~"$model"{role}}}, replica)')
                        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
                        .multi(True).include_all(True).all_value(".*")))
    pid = 0
    for row_title, panels in board.rows:
        pid += 1
        d = d.with_row(Row(row_title).id(pid))
        for p in panels:
            pid += 1
            ts = (TimeSeries().id(pid).title(p.title).description(p.description).unit(p.unit).datasource(ds)
                  .height(8).span(p.width).min(0)
                  .legend(cb.VizLegendOptions().display_mode(LegendDisplayMode.LIST)
                          .placement(LegendPlacement.BOTTOM).show_legend(True))
                  .tooltip(cb.VizTooltipOptions().mode(TooltipDisplayMode.MULTI)))
            for i, t in enumerate(p.targets):
                ts = ts.with_target(Dataquery().expr(t.expr).legend_format(t.legend).ref_id(chr(ord("A") + i))
                                    .datasource(ds))
            d = d.with_panel(ts)
    return json.loads(json.dumps(d.build(), cls=JSONEncoder))


def render(board: Board) -> str:
    """The file text of ``board``: stable key order, two-space indents, a final newline."""
    return json.dumps(build(board), indent=2, sort_keys=True) + "\n"


def generate() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {f"{b.name}.json": render(b) for b in (f() for f in BOARDS)}


def panel_queries(doc: dict) -> list[tuple[str, str]]:
    """``(panel title, expr)`` of every query of every panel of a dashboard JSON document."""
    return [(p["title"], t["expr"]) for p in doc["panels"] if p.get("type") != "row" for t in p.get("targets", [])]


def resolve(expr: str, rate_interval: str = "1m", model: str = ".*", replica: str = ".*") -> str:
    """``expr`` with Grafana's variables replaced, as Grafana sends it to Prometheus (for tests and docs)."""
    values = {"__rate_interval": rate_interval, "model": model, "replica": replica}
    return re.sub(r"\$(\w+)", lambda m: values[m.group(1)], expr)


def check(out_dir: Path = DASHBOARD_DIR) -> list[str]:
    """What differs between ``out_dir`` and the generated dashboards (empty: in step)."""
    want = generate()
    problems = []
    for name, text in want.items():
        path = out_dir / name
        if not path.exists():
            problems.append(f"{path}: missing")
        elif path.read_text() != text:
            problems.append(f"{path}: differs from what deployments/metrics/dashboards.py generates")
    for path in sorted(out_dir.glob("*.json")):
        if path.name not in want:
            problems.append(f"{path}: not generated by deployments/metrics/dashboards.py (remove it)")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deployments.metrics.dashboards", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the checked-in JSON differs from the code")
    ap.add_argument("--out", type=Path, default=DASHBOARD_DIR, help="directory of the JSON files")
    args = ap.parse_args(argv)
    if args.check:
        problems = check(args.out)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("regenerate with: python -m deployments.metrics.dashboards", file=sys.stderr)
        return 1 if problems else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in generate().items():
        (args.out / name).write_text(text)
        print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
