"""pytest glue for the nspawn harness: ``systemd_box`` (one container per test module, always torn down).

In a conftest.py: ``from tests.harness.fixture import systemd_box  # noqa: F401``; mark the tests
``@pytest.mark.systemd``. Skips (with the reason) where the harness cannot run: not root, no
systemd-nspawn and apt cannot install it.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from .nspawn import HarnessUnavailable, default_binds, down, unavailable, up

REPO = Path(__file__).resolve().parents[2]


def skip_unless_available() -> None:
    why = unavailable()
    if why:
        pytest.skip(f"systemd harness unavailable: {why}")


def booted_box():
    """Generator body of a box fixture: a booted container with the repo (and an out-of-repo venv) bound at the
    same paths, private network; skips when it cannot boot, always torn down. Call skip_unless_available first."""
    try:
        box = up(binds=default_binds(REPO))
    except HarnessUnavailable as exc:
        pytest.skip(f"systemd harness unavailable: {exc}")
    try:
        yield box
    finally:
        down(box)


@pytest.fixture(scope="module")
def systemd_box():
    """A booted container for one test module (see ``booted_box``)."""
    skip_unless_available()
    yield from booted_box()
