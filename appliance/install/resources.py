"""Where the unit templates and the documented config live (source tree, or the installed data files)."""
from __future__ import annotations

import sys
from pathlib import Path


def _first(*candidates: Path) -> Path:
    for c in candidates:
        if c.is_dir():
            return c
    raise FileNotFoundError(f"pdctl data directory not found (looked in {', '.join(map(str, candidates))}); "
                            "reinstall pdctl")


def units_dir() -> Path:
    return _first(Path(__file__).resolve().parents[2] / "units", Path(sys.prefix) / "share" / "pdctl" / "units")


def etc_dir() -> Path:
    return _first(Path(__file__).resolve().parents[2] / "etc", Path(sys.prefix) / "share" / "pdctl" / "etc")
