"""Can the unprivileged service user reach a path from inside a pdctl unit?  Stdlib only.

Why its own module: install.sh runs it with the bare system interpreter *before* it creates any venv
(``python3 appliance/install/pathcheck.py --interpreter``), so a Python the units cannot run (pyenv under /root:
``203/EXEC Permission denied``) is refused before anything is written; ``pdctl install`` imports the same
rules for the engine venv and the model. A path fails for one of three reasons, each with its own fix:

- it lies under a directory the units' sandbox hides (``units/hardening.inc``: ``PrivateTmp=yes`` gives
  them an empty /tmp and /var/tmp, ``ProtectHome=yes`` an empty /home, /root and /run/user);
- a directory on the way is not searchable by other users (``o+x`` missing);
- the file itself is not readable/executable by other users.
"""
from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

# directory -> the unit setting that hides it (units/hardening.inc; tests/foundation checks they agree)
HIDDEN_BY_UNITS = {
    "/tmp": "PrivateTmp=yes",
    "/var/tmp": "PrivateTmp=yes",
    "/home": "ProtectHome=yes",
    "/root": "ProtectHome=yes",
    "/run/user": "ProtectHome=yes",
}
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")


@dataclass(frozen=True)
class Unreachable:
    """Why the service user cannot reach ``path`` and the exact command that fixes it."""
    path: str
    why: str
    fix: str

    def message(self, what: str) -> str:
        return f"{what} {self.path}: {self.why}. Fix: {self.fix}"


def hidden_by(path: str) -> tuple[str, str] | None:
    """(hidden directory, unit setting) when ``path`` lies under a directory the units cannot see."""
    p = os.path.normpath(path)
    for d, setting in HIDDEN_BY_UNITS.items():
        if p == d or p.startswith(d + "/"):
            return d, setting
    return None


def _move_fix(path: str, setting: str, move_to: str) -> str:
    name = os.path.basename(os.path.normpath(path)) or "it"
    if setting == "PrivateTmp=yes":
        return f"the units run with PrivateTmp=yes (their /tmp and /var/tmp are private and empty): move it, " \
               f"e.g. `mv {path} {move_to}/{name}`, and point pdctl there"
    return f"the units run with ProtectHome=yes (they see no /home, /root or /run/user): move it, " \
           f"e.g. `mv {path} {move_to}/{name}`, and point pdctl there"


def cannot_reach(path: str | Path, want: str = "read", move_to: str = "/srv/pdctl") -> Unreachable | None:
    """None when the service user (neither root nor the owner) can ``want`` ("read" or "run") ``path``."""
    literal = os.path.abspath(str(path))
    real = os.path.realpath(literal)
    for p in dict.fromkeys((literal, real)):
        h = hidden_by(p)
        if h:
            why = f"it is under {h[0]}" + (f" (it resolves to {real})" if p != literal else "")
            return Unreachable(literal, why, _move_fix(literal, h[1], move_to))
    if not os.path.exists(real):
        return Unreachable(literal, "it does not exist", "create it, or point pdctl at the right path")
    for p in dict.fromkeys((literal, real)):
        for parent in reversed(Path(p).parents):
            mode = parent.stat().st_mode
            if not mode & stat.S_IXOTH:
                return Unreachable(literal, f"{parent} is mode {oct(mode & 0o777)}, not searchable by other users",
                                   f"`chmod o+x {parent}`, or move it out of {parent}")
    mode = os.stat(real).st_mode
    need = stat.S_IXOTH if (want == "run" or stat.S_ISDIR(mode)) else stat.S_IROTH
    if want == "read" and stat.S_ISDIR(mode):
        need |= stat.S_IROTH
    if mode & need != need:
        fix = f"`chmod o+rx {real}`" if want == "run" else f"`chmod -R a+rX {literal}`"
        return Unreachable(literal, f"{real} is mode {oct(mode & 0o777)}", fix)
    return None


def tree_cannot_reach(top: str | Path, limit: int = 2000) -> Unreachable | None:
    """The first file or directory under ``top`` (a model directory) the service user cannot read."""
    first = cannot_reach(top, "read")
    if first or not os.path.isdir(top):
        return first
    n = 0
    for d, dirs, files in os.walk(top):
        for name in dirs + files:
            n += 1
            if n > limit:
                return None
            p = os.path.join(d, name)
            mode = os.stat(p).st_mode
            need = (stat.S_IXOTH | stat.S_IROTH) if stat.S_ISDIR(mode) else stat.S_IROTH
            if mode & need != need:
                return Unreachable(str(top), f"{p} is mode {oct(mode & 0o777)}", f"`chmod -R a+rX {top}`")
    return None


def interpreter_problems(exe: str | None = None, stdlib: str | None = None) -> list[Unreachable]:
    """The interpreter (and its standard library) the units would run, as the service user sees them."""
    import sysconfig
    exe = exe or sys.executable
    stdlib = stdlib or sysconfig.get_paths()["stdlib"]
    better = next((p for p in SYSTEM_PYTHONS if os.path.realpath(p) != os.path.realpath(exe)
                   and os.access(p, os.X_OK) and not cannot_reach(p, "run")), None)
    hint = (f"use a system Python the service user can run: INSTALL_PDCTL_PYTHON={better} (or --python {better})"
            if better else "install a system Python >= 3.10 (apt-get install python3 python3-venv) and pass "
                           "INSTALL_PDCTL_PYTHON=/usr/bin/python3")
    for p, want in ((exe, "run"), (stdlib, "read")):
        u = cannot_reach(p, want)
        if u:   # one problem per interpreter: its stdlib fails for the same reason as its binary
            fix = hint if hidden_by(u.path) or hidden_by(os.path.realpath(u.path)) else f"{hint}; or {u.fix}"
            return [Unreachable(u.path, u.why + " (the units would fail with 203/EXEC)", fix)]
    return []


def _main(argv: list[str]) -> int:
    if argv[:1] != ["--interpreter"]:
        print("usage: python3 appliance/install/pathcheck.py --interpreter", file=sys.stderr)
        return 2
    probs = interpreter_problems()
    for u in probs:
        print(f"[ERROR] {u.message('the Python interpreter pdctl would run as the pdctl service user:')}",
              file=sys.stderr)
    return 2 if probs else 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
