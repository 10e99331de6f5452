"""Render the front node's files: ``pd-router.service`` and ``fleet.json``, the same way ``appliance.install.units`` does.

Pure text in, text out, so ``fleet install``, ``--dry-run`` and the tests see the same bytes.
"""
from __future__ import annotations

import json
from pathlib import Path

from .. import constants as C
from ..install.resources import units_dir
from ..install.units import RenderedFile, _fill
from .plan import FleetPlan


def render(fleet: FleetPlan, venv: str = str(C.VENV_DIR), fleet_path: Path = C.FLEET_PLAN) -> dict:
    """``{path without leading '/': RenderedFile}`` for the router unit and the fleet plan it reads."""
    tdir = units_dir()
    r = fleet.router
    values = {
        "ROUTER_VERSION": r.version, "NODE_COUNT": str(len(fleet.nodes)), "FLEET": str(fleet_path),
        "ROUTER_HOST": r.host, "ROUTER_PORT": str(r.port), "POLICY": r.policy,
        "NODES": " ".join(n.hostport for n in fleet.nodes),
        "PDCTL": f"{venv.rstrip('/')}/bin/pdctl",
        "HARDENING": (tdir / "hardening.inc").read_text().strip(),
    }
    return {
        f"{C.SYSTEMD_REL}/{C.ROUTER_UNIT}": RenderedFile(_fill((tdir / "pd-router.service.in").read_text(), values)),
        str(fleet_path).lstrip("/"): RenderedFile(json.dumps(fleet.to_json(), indent=2, sort_keys=True) + "\n"),
    }
