"""Run-time budgets per test module: a module whose run takes more than twice its budget fails the session.

Why: every round adds tests, and a suite that creeps past CI's limit fails everyone's submission at once. The
budgets (``tests/budgets.json``, seconds per module with its class: unit, stand-in, real_engine, systemd) are
the most a module took in the measured runs on the 2-core reference machine, with room (scripts/test-budgets.py);
README "Development" states their sums per class.

Not a timing verdict on the code: a budget is 2x away, and scaled by how slow this whole run is (the median, over
the modules judged, of seconds taken / budget, when above 1): a slow or busy machine slows every module and moves
every line with it, so only a module that grew against the others (more tests, a new sleep, a stack started per
test) crosses its line. Budgets have a floor (MIN_BUDGET_S) so that a module of a few seconds is not judged on
jitter.

A module cut short (``-x``) is not judged; a selection (``-k``, ``-m``, node ids) runs a part of a module, which
can only take less than the whole module's budget.

``PDCTL_TEST_DURATIONS=FILE`` writes every module's seconds to FILE (JSON), for scripts/test-budgets.py.
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

BUDGETS = Path(__file__).with_name("budgets.json")
GROWTH = 2.0                 # a module fails past GROWTH x its budget (x the run's slowness)
MIN_BUDGET_S = 5.0           # no module is judged on less
CLASSES = ("unit", "stand-in", "real_engine", "systemd")
UNIT_DIRS = ("tests/foundation/", "tests/policy/", "tests/plan/")    # pure: no process, no socket, no clock


def module_class(nodeid: str) -> str:
    """unit, stand-in, real_engine or systemd, from a report's node id (scripts/test.sh's xdist groups end it
    with ``@systemd`` / ``@real_engine``; without xdist, from the keywords)."""
    group = nodeid.rpartition("@")[2] if "@" in nodeid.rpartition("::")[2] else ""
    heavy = group.partition(":")[0]           # systemd:1, systemd:2 (tests/schedule.py)
    if heavy in ("systemd", "real_engine"):
        return heavy
    return "unit" if nodeid.startswith(UNIT_DIRS) else "stand-in"


@dataclass(frozen=True)
class Overrun:
    module: str
    seconds: float
    budget_s: float
    limit_s: float

    def __str__(self) -> str:
        if not self.budget_s:
            return (f"{self.module}: {self.seconds:.0f} s and no budget: add it to tests/budgets.json "
                    "(scripts/test-budgets.py writes the entries from a run)")
        return (f"{self.module}: {self.seconds:.0f} s, budget {self.budget_s:.0f} s (fails past {self.limit_s:.0f} s "
                f"in this run); make it faster, split it, or raise its budget in tests/budgets.json with why")


def module_seconds() -> dict[str, float]:
    """Module -> budgeted seconds (tests/schedule.py orders the xdist groups by them); {} without the file."""
    if not BUDGETS.exists():
        return {}
    return {m: e["budget_s"] for m, e in json.loads(BUDGETS.read_text())["modules"].items()}


def budget_of(entry: dict | None) -> float:
    return max(MIN_BUDGET_S, entry["budget_s"]) if entry else 0.0


def slowness(seconds: dict, budgets: dict) -> float:
    """How slow this run is against the budgets: the median of seconds / budget over the modules that have one."""
    ratios = sorted(s / budget_of(budgets[m]) for m, s in seconds.items() if m in budgets)
    if not ratios:
        return 1.0
    mid = len(ratios) // 2
    return ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2


def overruns(seconds: dict, budgets: dict) -> list:
    """Modules past GROWTH x budget x the run's slowness (when > 1), and modules that ran with no budget."""
    scale = max(1.0, slowness(seconds, budgets))
    out = []
    for module, s in sorted(seconds.items()):
        budget = budget_of(budgets.get(module))
        limit = GROWTH * budget * scale
        if module not in budgets or s > limit:
            out.append(Overrun(module, s, budget, limit))
    return out


class BudgetPlugin:
    def __init__(self, config):
        self.config = config
        self.seconds: dict = defaultdict(float)
        self.classes: dict = {}
        self.collected: dict = defaultdict(int)
        self.ran: dict = defaultdict(int)

    def pytest_collection_finish(self, session) -> None:
        for item in session.items:
            self.collected[item.nodeid.split("::")[0]] += 1

    def pytest_runtest_logreport(self, report) -> None:
        module = report.nodeid.split("::")[0]
        self.seconds[module] += report.duration
        kw = getattr(report, "keywords", {}) or {}
        cls = next((m for m in ("systemd", "real_engine") if m in kw), None) or module_class(report.nodeid)
        if module not in self.classes or CLASSES.index(cls) > CLASSES.index(self.classes[module]):
            self.classes[module] = cls        # a module is of the heaviest class any of its tests is
        if report.when == "teardown":
            self.ran[module] += 1

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        out = os.environ.get("PDCTL_TEST_DURATIONS")
        if out:
            Path(out).write_text(json.dumps({m: {"seconds": round(s, 1), "class": self.classes.get(m, "stand-in")}
                                             for m, s in sorted(self.seconds.items())}, indent=1))
        if exitstatus not in (0, 1) or not BUDGETS.exists():
            return
        # a module counts only when every selected test of it ran (-x cuts it short); a selection (-k, -m, node
        # ids) runs fewer of its tests, so it can only take less than the whole module's budget
        whole = {m: s for m, s in self.seconds.items() if self.ran[m] == self.collected[m]}
        budgets = json.loads(BUDGETS.read_text())["modules"]
        found = overruns(whole, budgets)
        if found:
            tr = self.config.pluginmanager.get_plugin("terminalreporter")
            lines = [f"test modules past {GROWTH:g}x their run-time budget (this run is "
                     f"{slowness(whole, budgets):.2f}x the budgets overall):"] + [f"  {o}" for o in found]
            if tr is not None:
                tr.write_line("\n".join(lines), red=True)
            session.exitstatus = 1


class XdistCollection:
    """Under xdist the controller collects nothing itself: each worker reports the ids it collected."""

    def __init__(self, plugin: BudgetPlugin):
        self.plugin = plugin
        self.seen = False

    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        if not self.seen:                           # every worker collects the same ids
            self.seen = True
            for nodeid in ids:
                self.plugin.collected[nodeid.split("::")[0]] += 1


def register(config) -> None:
    if hasattr(config, "workerinput"):              # under xdist only the controller judges (it sees every report)
        return
    plugin = BudgetPlugin(config)
    config.pluginmanager.register(plugin, "pdctl-budgets")
    if config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None):
        config.pluginmanager.register(XdistCollection(plugin), "pdctl-budgets-xdist")
