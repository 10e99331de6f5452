"""Checks of the generated Prometheus/Grafana files against a live stack's /metrics (twin or real engines).

Every dashboard expression is parsed by a real PromQL parser (promql-parser, the Rust crate's Python
binding) after the Grafana variables are substituted as Grafana does; every metric it selects must be one
the job's targets expose now: a sample, or a family declared by its ``# TYPE`` line (prometheus_client
declares a labelled counter before its first increment).
"""
from __future__ import annotations

import re
from typing import Callable

import promql_parser

from appliance.views import monitoring

GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "${datasource}": "prom"}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("_sum", "_count", "_created"), "gauge": ("",), "untyped": ("",), "info": ("_info",)}


def exposed(text: str) -> set[str]:
    """Sample names a scrape exposes, and the ones its ``# TYPE`` lines declare."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            base = name[:-len("_total")] if kind == "counter" and name.endswith("_total") else name
            names |= {base + s for s in SUFFIXES.get(kind.strip(), ("",))} | {name}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric name, job) of every vector selector in one PromQL expression (parsed, not grepped)."""
    for k, v in GRAFANA_VARS.items():
        expr = expr.replace(k, v)
    out: list = []

    def visit(node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            job = next((m.value for m in node.matchers.matchers if m.name == "job"), "")
            out.append((node.name, job))
    promql_parser.walk(promql_parser.parse(expr), visit)
    return out


def expressions(plan) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in monitoring.dashboard(plan)["panels"] for t in p["targets"]]


def check(plan, scrape: Callable[[str], str], awaited: frozenset = frozenset(),
          target_url: Callable[[str], str] = lambda t: f"http://{t}/metrics") -> tuple[list, dict]:
    """Problems (empty when every expression parses and names exposed metrics) and the names per job.

    ``scrape(url)`` returns a target's /metrics text; each job's targets come from ``scrape_config(plan)``
    (so the scrape config's targets are checked to answer too). ``awaited``: names not exposed yet by
    design (a metric another issue adds); they are reported in the names dict, never silently passed."""
    jobs: dict[str, set] = {}
    for job in monitoring.scrape_config(plan)["scrape_configs"]:
        names: set = set()
        for sc in job["static_configs"]:
            for t in sc["targets"]:
                names |= exposed(scrape(target_url(t)))
        jobs[job["job_name"]] = names
    problems = []
    for title, expr in expressions(plan):
        for name, job in selectors(expr):
            if job not in jobs:
                problems.append(f"{title}: {name} selects job {job!r}, not in the scrape config")
            elif name not in jobs[job] and name not in awaited:
                problems.append(f"{title}: {name} is not exposed by job {job}")
    return problems, jobs
