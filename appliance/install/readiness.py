"""The wait for readiness after a start: progress lines until the proxy's /ready answers, or the unit that
will not come up, named with why and its journal lines.
"""
from __future__ import annotations

import time

from .. import constants as C
from ..errors import CliError
from ..plan.types import Plan
from ..wire.fetch import fetch_sync
from .host import info, journal_tail, unit_state

# systemd's own exit statuses for a start that failed before the program ran (systemd.exec(5) "Process
# exit codes": 200 CHDIR .. 243 CREDENTIALS, e.g. 203 EXEC, 217 USER, 226 NAMESPACE): a restart cannot fix them
SPAWN_FAILURES = range(200, 244)
CRASH_LOOP_FAILURES = 2        # a unit that failed this often while we wait keeps failing: say so, stop waiting
HEARTBEAT_S = 10.0             # never more than this long without a progress line


def failed_for_good(st: dict, restarts0: int) -> str | None:
    """Why a unit will not come up by waiting longer, or None while it still might."""
    status = int(st.get("ExecMainStatus") or 0)
    failures = int(st.get("NRestarts") or 0) - restarts0 + (st.get("SubState") == "auto-restart")
    spawn = status in SPAWN_FAILURES and st.get("ExecMainCode") == "1"
    if st.get("ActiveState") == "failed":     # the start limit can come first on a busy box: still say why
        cause = f"; systemd could not start its program (exit status {status}: see systemd.exec(5))" if spawn else ""
        return f"it failed ({st.get('Result', '?')}{cause}) and systemd will not restart it"
    if spawn and failures >= 1:
        return f"systemd could not start its program (exit status {status}: see systemd.exec(5)); restarts " \
               "cannot fix that"
    if failures >= CRASH_LOOP_FAILURES:
        return f"it failed {failures} times since the install started it (status {status}); systemd keeps " \
               "restarting it, but it will keep failing until the cause below is fixed"
    return None


def wait_ready(plan: Plan, timeout: float) -> bool:
    """Progress lines (each unit's state and STATUS=) until the proxy's /ready answers 200, a heartbeat line at
    least every HEARTBEAT_S, and an early, explained exit when a unit has failed for good."""
    # the loopback side door's /ready: the same canary verdict, readable with TLS or keys on the public port
    url = C.loopback_url(plan.proxy.internal_port, "/ready")
    units = [C.KV_UNIT] + [w.unit for w in plan.workers] + [C.PROXY_UNIT]
    restarts0 = {u: int(unit_state(u).get("NRestarts") or 0) for u in units}
    info(f"waiting up to {timeout:.0f} s for {url} (a real request through every role)")
    t0 = last_t = time.monotonic()
    last = ""
    while time.monotonic() - t0 < timeout:
        states, all_active = [], True
        for u in units:
            st = unit_state(u)
            why = failed_for_good(st, restarts0[u])
            if why:
                raise UnitFailed(u, why)
            state, text = st.get("ActiveState", "?"), st.get("StatusText", "")
            all_active = all_active and state == "active"
            states.append(f"{u.replace('.service', '')}={state}" + (f" ({text})" if text and state != "active" else ""))
        if all_active:   # ready = every unit up and a real request through the roles (/ready's canary)
            if fetch_sync(url, timeout_s=2.0).status == 200:
                info(f"ready after {time.monotonic() - t0:.0f} s: {url} answered 200")
                return True
        line = ", ".join(states)
        now = time.monotonic()
        if line != last or now - last_t >= HEARTBEAT_S:
            info(f"{now - t0:4.0f} s: {line}")
            last, last_t = line, now
        time.sleep(1.0)
    return False


class UnitFailed(CliError):
    """A unit that will not come up: names it, says why, and shows the journal lines that explain it."""

    def __init__(self, unit: str, why: str):
        hint = ""
        tail = journal_tail(unit)
        if "203/EXEC" in tail or "Permission denied" in tail:
            hint = ("\n  203/EXEC or Permission denied: the pdctl user cannot run the program (an interpreter under "
                    "/root or a 0700 directory); re-run install.sh with INSTALL_PDCTL_PYTHON=/usr/bin/python3")
        super().__init__(f"{unit} will not come up: {why}.\n  Its last journal lines "
                         f"(journalctl -u {unit}):\n" + "\n".join("    " + ln for ln in tail.splitlines()) + hint
                         + f"\n  Fix the cause, then `sudo pdctl apply` (or `systemctl restart {unit}`); "
                           "`pdctl status` shows every unit", 1)
