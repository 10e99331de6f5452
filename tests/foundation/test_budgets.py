"""The run-time budget guard (tests/budgets.py): a module past twice its budget fails the session, scaled by how
slow the whole run is, so a slow machine moves every line and only a module that grew against the others trips."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

import budgets  # noqa: E402  (tests/ is not a package)


def _b(**seconds):
    return {f"tests/x/test_{k}.py": {"class": "stand-in", "budget_s": v} for k, v in seconds.items()}


def _s(**seconds):
    return {f"tests/x/test_{k}.py": v for k, v in seconds.items()}


def test_a_module_past_twice_its_budget_is_named_with_the_way_out():
    found = budgets.overruns(_s(a=10, b=21, c=41, d=20, e=9), _b(a=10, b=10, c=20, d=20, e=10))
    assert [o.module for o in found] == ["tests/x/test_b.py", "tests/x/test_c.py"]
    assert "budget 10 s (fails past 20 s" in str(found[0]) and "tests/budgets.json" in str(found[0])


def test_a_slow_run_moves_every_line_with_it():
    """Every module 3x slower (a busy machine): nothing trips; one module 7x slower in that run trips."""
    b = _b(a=10, b=10, c=10, d=10, e=10)
    assert budgets.slowness(_s(a=30, b=30, c=30, d=30, e=30), b) == 3.0
    assert budgets.overruns(_s(a=30, b=30, c=30, d=30, e=30), b) == []
    assert [o.module for o in budgets.overruns(_s(a=30, b=30, c=30, d=30, e=70), b)] == ["tests/x/test_e.py"]


def test_a_fast_run_does_not_tighten_the_lines_and_small_modules_have_a_floor():
    b = _b(a=100, b=100, c=1)
    assert budgets.overruns(_s(a=10, b=10, c=2 * budgets.MIN_BUDGET_S - 0.1), b) == []
    assert [o.module for o in budgets.overruns(_s(a=10, b=10, c=2 * budgets.MIN_BUDGET_S + 0.1), b)] == \
        ["tests/x/test_c.py"]


def test_a_module_without_a_budget_is_named():
    found = budgets.overruns(_s(a=1, new=1), _b(a=10))
    assert [o.module for o in found] == ["tests/x/test_new.py"] and "no budget" in str(found[0])


def test_the_classes_come_from_the_xdist_group_or_the_directory():
    assert budgets.module_class("tests/install/test_x.py::test_y@systemd") == "systemd"
    assert budgets.module_class("tests/install/test_x.py::test_y@systemd:2") == "systemd"
    assert budgets.module_class("tests/real/test_x.py::test_y[a@b]@real_engine") == "real_engine"
    assert budgets.module_class("tests/plan/test_planner.py::test_golden[x]") == "unit"
    assert budgets.module_class("tests/proxy/test_x.py::test_y@tests/proxy/test_x.py") == "stand-in"


def test_the_budgets_file_covers_every_module_of_the_suite():
    table = json.loads(budgets.BUDGETS.read_text())["modules"]
    modules = {str(p.relative_to(TESTS.parent)) for p in TESTS.rglob("test_*.py")}
    assert sorted(modules - table.keys()) == [], "give each new module a budget (scripts/test-budgets.py)"
    assert sorted(table.keys() - modules) == [], "drop the budgets of modules that are gone"
    assert {v["class"] for v in table.values()} <= set(budgets.CLASSES)


def test_a_session_with_a_module_past_its_budget_fails(tmp_path):
    """End to end through pytest: the guard turns a green session red and says which module and why."""
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nimport budgets\nfrom pathlib import Path\n"
        f"budgets.BUDGETS = Path({str(tmp_path / 'budgets.json')!r})\nbudgets.MIN_BUDGET_S = 0.05\n"
        "def pytest_configure(config):\n    budgets.register(config)\n")
    (tmp_path / "test_slow.py").write_text("import time\ndef test_slow():\n    time.sleep(0.6)\n")
    for name in ("a", "b", "c"):
        (tmp_path / f"test_quick_{name}.py").write_text("def test_quick():\n    pass\n")

    def run(slow_budget: float):
        (tmp_path / "budgets.json").write_text(json.dumps({"modules": {
            "test_slow.py": {"class": "stand-in", "budget_s": slow_budget},
            **{f"test_quick_{n}.py": {"class": "stand-in", "budget_s": 1.0} for n in ("a", "b", "c")}}}))
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                               str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120)

    ok = run(slow_budget=60.0)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    over = run(slow_budget=0.1)
    assert over.returncode == 1, over.stdout + over.stderr
    assert "4 passed" in over.stdout and "past 2x their run-time budget" in over.stdout, over.stdout
    assert "  test_slow.py: " in over.stdout and "test_quick" not in over.stdout.split("budget")[-1], over.stdout
