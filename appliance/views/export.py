"""``pdctl export prometheus|llm-d``: the plan for other platforms, one verb with a target per platform.

Why its own module: the targets live in two rooms (the box's scrape config and dashboard in views/monitoring.py,
the Kubernetes manifests in fleet/), and the views may import the fleet but not the other way round.
"""
from __future__ import annotations

from ..fleet.cli import register_export_llmd
from .monitoring import register_export


def register(subparsers) -> None:
    exp = subparsers.add_parser("export", help="the plan for other platforms (llm-d on Kubernetes)")
    esub = exp.add_subparsers(dest="export_verb", required=True, metavar="TARGET")
    register_export_llmd(esub)
    register_export(esub)       # pdctl export prometheus (scrape config + Grafana)
