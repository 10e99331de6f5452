#!/usr/bin/env python3
"""Write tests/budgets.json from a measured run, and print the budget per class for README "Development".

    PDCTL_TEST_DURATIONS=/var/tmp/durations.json ./scripts/test.sh      # the whole suite, as CI runs it
    python3 scripts/test-budgets.py /var/tmp/durations.json [MORE.json ...]   # review the diff, commit it with why

A module's budget is the most it took in the runs given (with xdist a module's time depends on what runs beside
it), half again more (at least 10 s more), rounded up to 5 s; tests/budgets.py fails a run where a module takes
more than twice its budget, scaled by how slow that whole run is.
"""
from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

BUDGETS = Path(__file__).resolve().parents[1] / "tests" / "budgets.json"
CLASSES = ("unit", "stand-in", "real_engine", "systemd")


def budget(seconds: float) -> float:
    return 5.0 * math.ceil(max(1.5 * seconds, seconds + 10.0) / 5.0)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    measured: dict = {}
    for path in argv:
        for m, v in json.loads(Path(path).read_text()).items():
            was = measured.get(m, {"seconds": 0.0, "class": "unit"})
            measured[m] = {"seconds": max(was["seconds"], v["seconds"]),
                           "class": max(was["class"], v["class"], key=CLASSES.index)}
    tests = Path(__file__).resolve().parents[1]
    measured = {m: v for m, v in measured.items() if (tests / m).exists()}     # modules since moved or gone
    modules = {m: {"class": v["class"], "budget_s": budget(v["seconds"])} for m, v in sorted(measured.items())}
    BUDGETS.write_text(json.dumps({"modules": modules}, indent=1) + "\n")
    per_class: dict = defaultdict(lambda: [0, 0.0, 0.0])
    for m, v in measured.items():
        c = per_class[v["class"]]
        c[0] += 1
        c[1] += v["seconds"]
        c[2] += modules[m]["budget_s"]
    print(f"wrote {BUDGETS} ({len(modules)} modules)")
    print("| class | modules | measured (test seconds) | budget |")
    print("|---|---|---|---|")
    for cls in CLASSES:
        n, s, b = per_class.get(cls, (0, 0.0, 0.0))
        print(f"| {cls} | {n} | {s:.0f} s | {b:.0f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
