"""``pdctl export prometheus``: a Prometheus scrape config for the plan's ports and a Grafana dashboard for
the same numbers the TUI shows, from the proxy's, the engines' and LMCache's own ``/metrics``.

Generated from the Plan (the one owner of ports) and the metric-name owners (appliance/constants.py,
appliance/metric_names.py), so a port or a name changes in one place. Every target is on loopback,
as the plan binds them: Prometheus runs on the box (or scrapes through an exporter the operator trusts).
The checked-in etc/prometheus/pdctl.yml and etc/grafana/pdctl-dashboard.json are this module's output
for the default plan (a test keeps them so).

What PromQL cannot say the TUI's way is said in the panel's description: the dashboard's cached-prompt
share counts a split request's D leg (a KV transfer) as cached, where the TUI's "prefill saved" leaves
it out per worker by the proxy's legs counters.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .. import constants as C
from .. import metric_names as N
from ..policy.admit import REFUSE

JOB_PROXY, JOB_ENGINES, JOB_KV = "pdctl-proxy", "pdctl-engines", "pdctl-kvcache"
SCRAPE_INTERVAL = "5s"
RATE = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
YML_NAME, DASHBOARD_NAME = "prometheus/pdctl.yml", "grafana/pdctl-dashboard.json"


def scrape_config(plan: Any) -> dict:
    """prometheus.yml ``scrape_configs`` for one box: the proxy, every worker (labelled with its instance
    and role), the KV server."""
    workers = [{"targets": [f"{C.LOOPBACK}:{w.port}"], "labels": {"worker": w.instance, "role": w.role}}
               for w in plan.workers]
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "scrape_configs": [
            {"job_name": JOB_PROXY, "metrics_path": "/metrics",
             "static_configs": [{"targets": [f"{C.LOOPBACK}:{plan.proxy.internal_port}"]}]},   # side door: no API key
            {"job_name": JOB_ENGINES, "metrics_path": "/metrics", "static_configs": workers},
            {"job_name": JOB_KV, "metrics_path": "/metrics",
             "static_configs": [{"targets": [f"{C.LOOPBACK}:{plan.kv_server.http_port}"]}]},
        ],
    }


def _q(q: float, family: str, job: str) -> str:
    return f'histogram_quantile({q}, sum by (le) (rate({family}_bucket{{job="{job}"}}[{RATE}])))'


def _rate(sample: str, job: str, sel: str = "", by: str = "") -> str:
    inner = f'rate({sample}{{job="{job}"{"," + sel if sel else ""}}}[{RATE}])'
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def _ratio(hits: str, queries: str, job: str) -> str:
    return f"{_rate(hits, job)} / {_rate(queries, job)}"


OK_OUTCOMES = "|".join(sorted(N.CLIENT_OUTCOMES))


def panels() -> list[dict]:
    """(title, unit, description, [(legend, expr)]) per panel, in the TUI's order."""
    e, px, kv = JOB_ENGINES, JOB_PROXY, JOB_KV
    client = f'route!="{N.CANARY_ROUTE}"'
    return [
        ("TTFT p50 / p95 (proxy)", "s", "Arrival at the proxy to the first token out, all requests.",
         [("p50", _q(0.5, C.PROXY_TTFT, px)), ("p95", _q(0.95, C.PROXY_TTFT, px))]),
        ("TPOT p50 / p95 (engines)", "s", "Time between output tokens over every token the engines streamed "
         "(vLLM inter-token latency; a P leg emits one token and adds nothing).",
         [("p50", _q(0.5, C.VLLM_ITL, e)), ("p95", _q(0.95, C.VLLM_ITL, e))]),
        ("Requests, errors, migrations /s", "reqps", "Client requests through the proxy (its canary left "
         "out); errors: box-side failures (not the client's 4xx, nor admission's refusals); migrations: streams "
         "moved to another worker.",
         [("requests", _rate(C.PROXY_REQUESTS + "_total", px, client)),
          ("errors", _rate(C.PROXY_REQUESTS + "_total", px, f'{client},outcome!~"{OK_OUTCOMES}"')),
          ("migrations {{outcome}}", _rate(N.PROXY_MIGRATIONS + "_total", px, by="outcome"))]),
        ("Goodput and refusals /s", "reqps", "Goodput: streamed answers within both SLOs (TTFT from arrival, "
         "the answer's own TPOT); always read beside the refusals (a goodput that hides its refusals is "
         "inflated): requests admission refused with 503 + Retry-After before any engine saw them.",
         [("goodput", _rate(C.PROXY_GOOD + "_total", px)),
          ("refused", _rate(C.PROXY_ADMISSION + "_total", px, f'outcome="{REFUSE}"')),
          ("requests", _rate(C.PROXY_REQUESTS + "_total", px, client))]),
        ("Tokens /s", "short", "Prompt tokens the engines took in and tokens they generated.",
         [("in", _rate(C.VLLM_PROMPT_TOKENS + "_total", e)), ("out", _rate(C.VLLM_GENERATION_TOKENS + "_total", e))]),
        ("Cached prompt tokens (engines)", "percentunit", "Prompt tokens the engines took from a cache / all "
         "prompt tokens. Counts a split request's D leg (a KV transfer) as cached: the TUI's 'prefill saved' "
         "leaves D legs out per worker.",
         [("cached share", _ratio(C.VLLM_PROMPT_CACHED + "_total", C.VLLM_PROMPT_TOKENS + "_total", e))]),
        ("KV hit rate by layer", "percentunit", "Engine prefix cache, LMCache connector, LMCache server: "
         "hit tokens / looked-up tokens.",
         [("engine prefix", _ratio(C.VLLM_PREFIX_HITS + "_total", C.VLLM_PREFIX_QUERIES + "_total", e)),
          ("connector", _ratio(C.VLLM_EXT_PREFIX_HITS + "_total", C.VLLM_EXT_PREFIX_QUERIES + "_total", e)),
          ("KV server", _ratio(C.LMC_LOOKUP_HIT + "_total", C.LMC_LOOKUP_REQUESTED + "_total", kv))]),
        ("LMCache L1", "percentunit", "The KV server's host-RAM cache in use (ratio), and evicted chunks/s.",
         [("in use", f'max({C.LMC_L1_USAGE_RATIO}{{job="{kv}"}})'),
          ("evictions/s", _rate(C.LMC_L1_EVICTED_CHUNKS + "_total", kv))]),
        ("Decisions /s by kind and reason", "reqps", "Aggregated (one worker) or split (P leg, D leg), and why "
         "(appliance/policy/decide.py).",
         [("{{kind}} {{reason}}", _rate(C.PROXY_DECISIONS + "_total", px, by="kind, reason"))]),
        ("Admission verdicts /s by outcome and reason", "reqps", "admit (started), queue (waited in the "
         "proxy's queue), refuse (503 + Retry-After), and why (appliance/policy/admit.py); a request that waited and "
         "then started counts once as queue and once as admit.",
         [("{{outcome}} {{reason}}", _rate(C.PROXY_ADMISSION + "_total", px, by="outcome, reason"))]),
        ("Admission queue depth", "short", "Requests waiting in the proxy's admission queue now.",
         [("waiting", f'max({C.PROXY_QUEUE_DEPTH}{{job="{px}"}})')]),
        ("Admission queue wait p50 / p95", "s", "Time a request spent in the admission queue (started or "
         "refused).",
         [("p50", _q(0.5, C.PROXY_QUEUE_WAIT, px)), ("p95", _q(0.95, C.PROXY_QUEUE_WAIT, px))]),
        ("Running / waiting per worker", "short", "vLLM's scheduler gauges, per worker.",
         [("{{worker}} running", f'sum by (worker) ({C.VLLM_RUNNING}{{job="{e}"}})'),
          ("{{worker}} waiting", f'sum by (worker) ({C.VLLM_WAITING}{{job="{e}"}})')]),
        ("KV cache in use per worker", "percentunit", "The engine's KV blocks in use.",
         [("{{worker}}", f'max by (worker) ({C.VLLM_KV_USAGE}{{job="{e}"}})')]),
        ("Legs in flight per backend", "short", "Legs the proxy has open: full (aggregated), prefill, decode.",
         [("{{backend}} {{leg}}", f'sum by (backend, leg) ({C.PROXY_LEGS_INFLIGHT}{{job="{px}"}})')]),
        ("Breaker state per backend", "short", "0 closed (used), 1 open (skipped), 2 half-open.",
         [("{{backend}}", f'max by (backend) ({C.PROXY_BACKEND_STATE}{{job="{px}"}})')]),
        ("Preemptions /s per worker", "short", "Requests the engine preempted (KV cache full).",
         [("{{worker}}", _rate(C.VLLM_PREEMPTIONS + "_total", e, by="worker"))]),
    ]


def dashboard(plan: Any) -> dict:
    """A Grafana dashboard (schemaVersion 39): one timeseries panel per number, 2 per row."""
    out = []
    for i, (title, unit, desc, targets) in enumerate(panels()):
        out.append({
            "id": i + 1, "type": "timeseries", "title": title, "description": desc, "datasource": DATASOURCE,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
            "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend,
                         "datasource": DATASOURCE} for j, (legend, expr) in enumerate(targets)],
        })
    model = plan.served_model_name or plan.model
    return {
        "title": "pdctl", "uid": "pdctl-box", "tags": ["pdctl", "vllm", "lmcache"], "editable": True,
        "schemaVersion": 39, "version": 1, "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
        "description": f"pdctl box: {len(plan.workers)} workers of {model} ({plan.mode}); generated by "
                       "`pdctl export prometheus` from the plan",
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus"}]},
        "panels": out,
    }


def write(plan: Any, out: Path) -> list[Path]:
    from .. import yamlout
    out = Path(out)
    yml, dash = out / YML_NAME, out / DASHBOARD_NAME
    for p in (yml, dash):
        p.parent.mkdir(parents=True, exist_ok=True)
    yml.write_text("# Prometheus scrape config for one pdctl box, generated by `pdctl export prometheus` "
                   "from the plan.\n# Merge scrape_configs into your prometheus.yml; every target is on loopback.\n"
                   + yamlout.dump(scrape_config(plan)))
    dash.write_text(json.dumps(dashboard(plan), indent=2) + "\n")
    return [yml, dash]


def cmd_export_prometheus(args: argparse.Namespace) -> int:
    from ..plan.installed import load_plan
    from ..settings.config import ConfigError
    try:
        plan = load_plan(args.config)
    except ConfigError as exc:
        print(f"pdctl export prometheus: {exc}", file=sys.stderr)
        return 2
    if args.out is None:
        from .. import yamlout
        sys.stdout.write(yamlout.dump(scrape_config(plan)))
        return 0
    for p in write(plan, args.out):
        print(f"wrote {p}")
    return 0


def register_export(esub: argparse._SubParsersAction) -> None:
    """``pdctl export prometheus`` beside ``pdctl export llm-d``."""
    p = esub.add_parser("prometheus", help="Prometheus scrape config + Grafana dashboard for this box's plan")
    p.add_argument("--config", type=Path, default=C.CONFIG_PATH, help="pdctl.toml or plan.json")
    p.add_argument("--out", type=Path, default=None,
                   help=f"directory: writes {YML_NAME} and {DASHBOARD_NAME} (default: the scrape config to stdout)")
    p.set_defaults(func=cmd_export_prometheus)
