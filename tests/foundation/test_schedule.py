"""tests/schedule.py: the systemd modules split into balanced groups, the groups ordered longest first."""
from __future__ import annotations

import schedule


def test_spread_puts_the_longest_module_first_each_into_the_lightest_bin():
    got = schedule.spread({"a": 925, "b": 290, "c": 260, "d": 180, "e": 165, "f": 145, "g": 110}, 2)
    assert got["a"] == 0 and {got[m] for m in "bcde"} == {1}
    loads = [sum(s for m, s in {"a": 925, "b": 290, "c": 260, "d": 180, "e": 165, "f": 145, "g": 110}.items()
                 if got[m] == b) for b in (0, 1)]
    assert abs(loads[0] - loads[1]) <= 145          # no worse than the LPT rule's bound: the smallest module


def test_spread_is_deterministic_and_fills_every_bin_it_can():
    mods = {"x": 10.0, "y": 10.0, "z": 10.0}
    assert schedule.spread(mods, 2) == schedule.spread(dict(reversed(list(mods.items()))), 2)
    assert set(schedule.spread(mods, 3).values()) == {0, 1, 2}
    assert schedule.spread({}, 2) == {}


def test_groups_are_the_marker_a_systemd_bin_or_the_module():
    assert schedule.group_of("tests/real/test_a.py", "real_engine", {}) == "real_engine"
    assert schedule.group_of("tests/install/test_b.py", "systemd", {"tests/install": 1}) == "systemd:2"
    assert schedule.group_of("tests/proxy/test_c.py", None, {}) == "tests/proxy/test_c.py"


def test_longest_group_first_and_each_group_keeps_its_order():
    items = ["p1", "p2", "r1", "r2", "s1", "q1"]
    group = {"p1": "P", "p2": "P", "r1": "R", "r2": "R", "s1": "S", "q1": "Q"}
    module = {"p1": "mp", "p2": "mp", "r1": "mr1", "r2": "mr2", "s1": "ms", "q1": "mq"}
    seconds = {"mp": 20.0, "mr1": 50.0, "mr2": 60.0, "ms": 5.0}      # mq has no budget: UNKNOWN_S
    assert schedule.longest_first(items, group, module, seconds) == ["r1", "r2", "q1", "p1", "p2", "s1"]


def test_a_directory_of_systemd_modules_stays_in_one_group():
    """tests/faults shares one installed container (a package fixture) among its modules."""
    mods = {"tests/faults/a.py": 290, "tests/faults/b.py": 180, "tests/realsd/r.py": 925, "tests/install/i.py": 260}
    dirs = schedule.by_directory(mods)
    assert dirs == {"tests/faults": 470, "tests/realsd": 925, "tests/install": 260}
    bins = schedule.spread(dirs, 2)
    assert bins["tests/realsd"] != bins["tests/faults"] == bins["tests/install"]
    assert {schedule.group_of(m, "systemd", bins) for m in ("tests/faults/a.py", "tests/faults/b.py")} == {"systemd:2"}
