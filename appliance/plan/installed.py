"""The installed plan read back: ``plan.json`` beside ``pdctl.toml`` (written by ``pdctl install|apply``), for
every verb that acts on an installed box (status, doctor, bench, the proxy, the launcher, the TUI).

Why here and not in settings/: the settings room comes before the plan (the planner reads settings' schema);
reading a Plan back belongs to the room that owns the Plan.
"""
from __future__ import annotations

import json
from pathlib import Path

from .. import constants as C
from ..settings.config import ConfigError
from .types import Plan


def plan_path(config_path: Path = C.CONFIG_PATH) -> Path:
    return config_path.parent / "plan.json"


def load_plan(path: Path | str | None = None):
    """The installed Plan: ``plan.json`` (or the ``plan.json`` next to a given ``pdctl.toml``)."""
    p = Path(path) if path else plan_path()
    if p.suffix == ".toml":
        p = plan_path(p)
    try:
        return Plan.from_json(json.loads(p.read_text()))
    except FileNotFoundError:
        raise ConfigError(f"{p}: not found; install first (`sudo ./install.sh`) or pass --config") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{p}: not a pdctl plan ({exc!r}); regenerate it with `sudo pdctl apply`") from exc
