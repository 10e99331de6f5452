"""Restart, kill, reload the proxy and freeze the KV server under load, under the real systemd (nspawn harness).

After ``install.sh --simulate`` (twin engines, twin KV server; the package fixture of tests/faults), with the
fault suite's open-loop load (8 req/s of 16-token streams, loadclient.py):
- ``systemctl restart pd-proxy``: 0 refused connections, 0 broken streams (pd-proxy.socket holds the
  listening sockets; the old proxy drains, the new one takes the sockets from LISTEN_FDS);
- ``kill -9`` of the proxy: 0 refused connections (clients wait in the socket's backlog for the restarted
  proxy); the streams it was serving are cut, and counted;
- ``pdctl apply`` of a proxy-only change: a reload (SIGHUP, RELOADING=1 .. READY=1), same process, 0 errors;
- the KV server frozen with SIGSTOP past its ``WatchdogSec``: systemd aborts and restarts it, the workers
  come back (KV hits on the new server), and no request waits longer than a stated bound.
Prints what it measured as a table (LIFECYCLE_TABLE).
"""
from __future__ import annotations

import json
import re
import time

import pytest

from .common import (LOAD_RPS, PDCTL, Load, curl, engine_pid, kv_counters, main_pid, plan, proxy_status, restarts,
                     wait_until)

pytestmark = [pytest.mark.systemd, pytest.mark.slow]

PROXY, SOCKET, KV = "pd-proxy.service", "pd-proxy.socket", "pd-kvcache.service"
LOAD_S = 16.0
INJECT_AT = 4.0
KV_WATCHDOG_S = 10.0          # [kv_server] watchdog_s for the freeze test (the default is 30 s)
CONF = "/etc/pdctl/pdctl.toml"
LIFECYCLE_TABLE: list = []


def model(box) -> str:
    p = plan(box)
    return p.get("served_model_name") or p["model"]


COLS = (("fault", "event"), ("sent", "sent"), ("ok", "ok"), ("refused", "refused"), ("cut", "cut (in flight)"),
        ("stream_errors", "stream errors"), ("503", "503"), ("other", "other"), ("silent", "silent 200s"),
        ("recover_s", "back (s)"), ("max_latency_s", "max latency (s)"), ("note", "note"))


def render(rows: list) -> str:
    out = ["| " + " | ".join(t for _, t in COLS) + " |", "|" + "|".join("---" for _ in COLS) + "|"]
    out += ["| " + " | ".join("-" if r.get(k) is None else str(r[k]) for k, _ in COLS) + " |" for r in rows]
    return "\n".join(out)


def record(name: str, res: dict, recover_s, note: str = "") -> dict:
    row = {"fault": name, "sent": res["sent"], "ok": res["ok"], "refused": res["refused"], "503": res["e503"],
           "stream_errors": res["stream_error"], "cut": res["cut"], "other": res["other"], "silent": res["silent"],
           "recover_s": None if recover_s is None else round(recover_s, 1), "max_latency_s": res.get("max_s"),
           "note": note}
    LIFECYCLE_TABLE.append(row)
    print("LIFECYCLE", json.dumps(row), "examples", json.dumps(res.get("examples", {}))[:600])
    return row


def ready(box) -> bool:
    return curl(box, "http://127.0.0.1:9000/ready")[0] == 200


def set_keys(box, section: str, values: dict) -> str:
    """Set keys of one section of pdctl.toml in the box (line by line, comments kept); returns the old text."""
    old = box.read(CONF)
    lines = old.splitlines()
    if f"[{section}]" not in lines:
        lines += ["", f"[{section}]"]
    start = lines.index(f"[{section}]") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("[")), len(lines))
    for k, v in values.items():
        hit = next((i for i in range(start, end) if re.match(rf"{k}\s*=", lines[i])), None)
        if hit is None:
            lines.insert(start, f"{k} = {json.dumps(v)}")
            end += 1
        else:
            lines[hit] = f"{k} = {json.dumps(v)}"
    box.write(CONF, "\n".join(lines) + "\n")
    return old


def apply(box) -> str:
    r = box.run([PDCTL, "apply"], timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout + r.stderr


@pytest.fixture(scope="module")
def box(installed):
    assert wait_until(lambda: ready(installed), 120), "the appliance is not ready"
    yield installed
    print("\n" + render(LIFECYCLE_TABLE))


def test_the_socket_unit_holds_both_ports(box):
    assert box.show(SOCKET, "ActiveState")["ActiveState"] == "active"
    listen = box.run(["systemctl", "show", SOCKET, "-p", "Listen"], timeout=30).stdout   # one line per socket
    assert "Listen=0.0.0.0:9000 (Stream)" in listen and "Listen=127.0.0.1:9001 (Stream)" in listen, listen
    lines = [e.get("MESSAGE", "") for e in box.journal(PROXY)]
    assert any("sockets from systemd: internal, public" in m for m in lines), lines[-10:]


def test_restart_under_load_refuses_nobody_and_breaks_no_stream(box):
    pid0 = main_pid(box, PROXY)
    load = Load(box, model(box), LOAD_RPS, LOAD_S)
    time.sleep(INJECT_AT)
    t0 = time.monotonic()
    r = box.systemctl("restart", PROXY, timeout=120)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert wait_until(lambda: ready(box), 30), "proxy not ready within 30 s of its restart"
    recover = time.monotonic() - t0
    res = load.result()
    record("systemctl restart pd-proxy", res, recover, f"restart job {took:.1f} s (drain + start)")
    assert main_pid(box, PROXY) != pid0, "the proxy did not restart"
    assert "crashed" not in res, res
    assert res["refused"] == 0 and res["other"] == 0 and res["cut"] == 0, res
    assert res["stream_error"] == 0 and res["silent"] == 0, res
    assert res["ok"] == res["sent"], res
    drained = [e.get("MESSAGE", "") for e in box.journal(PROXY) if "drained" in e.get("MESSAGE", "")]
    assert drained and "'cut_at_deadline': 0" in drained[-1], drained[-1:]


def test_kill9_under_load_refuses_nobody(box):
    before = restarts(box, PROXY)
    load = Load(box, model(box), LOAD_RPS, LOAD_S)
    time.sleep(INJECT_AT)
    t0 = time.monotonic()
    box.run(["kill", "-9", str(main_pid(box, PROXY))], check=True)
    t_killed = time.monotonic()                    # the signal was sent: nothing sent after this reaches the process
    box.wait_show(PROXY, timeout=60, ActiveState="active", NRestarts=str(before + 1))
    assert wait_until(lambda: ready(box), 30), "proxy not ready within 30 s of its kill"
    recover = time.monotonic() - t0
    res = load.result()
    record("kill -9 pd-proxy", res, recover, "requests the killed process held are cut (the client raises); new "
                                             "connections wait in the socket's backlog")
    assert "crashed" not in res, res
    assert res["refused"] == 0 and res["other"] == 0, f"connections were refused or failed: {res}"
    assert res["silent"] == 0 and res["done_after_error"] == 0, res
    assert res["ok"] + res["cut"] == res["sent"], res
    # only what was in flight is cut: every cut request was sent before the kill (the container's monotonic clock
    # is the host's). An order of events, not "streams last < 2 s", which a busy machine stretches
    assert len(res["cut_started"]) == res["cut"] and all(s < t_killed for s in res["cut_started"]), \
        (t_killed, res["cut_started"])


def test_apply_of_a_proxy_setting_reloads_without_a_restart(box):
    pid0, n0 = main_pid(box, PROXY), restarts(box, PROXY)
    old = set_keys(box, "listener", {"max_connections": 2048, "keepalive_timeout_s": 60.0})
    try:
        load = Load(box, model(box), LOAD_RPS, LOAD_S)
        time.sleep(INJECT_AT)
        t0 = time.monotonic()
        out = apply(box)
        took = time.monotonic() - t0
        res = load.result()
    finally:
        box.write(CONF, old)
    record("pdctl apply (proxy setting): reload", res, None, f"apply took {took:.1f} s; same proxy process")
    assert "reloading pd-proxy.service" in out and "restarting pd-proxy" not in out, out[-1500:]
    assert main_pid(box, PROXY) == pid0 and restarts(box, PROXY) == n0, "the proxy was restarted, not reloaded"
    msgs = [e.get("MESSAGE", "") for e in box.journal(PROXY)]
    assert any("pdctl proxy reloaded: settings: keepalive_timeout_s, max_connections" in m for m in msgs), msgs[-5:]
    assert res["ok"] == res["sent"], res
    out = apply(box)                                     # back to the installed settings: another reload
    assert "reloading pd-proxy.service" in out and main_pid(box, PROXY) == pid0


def test_admission_mode_switched_by_reload_under_load_drops_nothing(box):
    """`[admission] mode` from slo to queue and back, each by `pdctl apply` (a reload: plan.json only) while the
    load runs: the same proxy process, every request answered, and the proxy's status says the new mode."""
    pid0 = main_pid(box, PROXY)
    assert (proxy_status(box) or {}).get("admission", {}).get("mode") == "slo"
    old = set_keys(box, "admission", {"mode": "queue"})
    try:
        load = Load(box, model(box), LOAD_RPS, LOAD_S)
        time.sleep(INJECT_AT)
        out = apply(box)
        mode_then = (proxy_status(box) or {}).get("admission", {}).get("mode")
        box.write(CONF, old)
        back = apply(box)
        res = load.result()
    finally:
        box.write(CONF, old)
    record("pdctl apply ([admission] mode slo -> queue -> slo): reload", res, None, "same proxy process")
    assert "reloading pd-proxy.service" in out and "reloading pd-proxy.service" in back, (out + back)[-1500:]
    assert main_pid(box, PROXY) == pid0, "the proxy was restarted, not reloaded"
    assert mode_then == "queue" and (proxy_status(box) or {}).get("admission", {}).get("mode") == "slo"
    msgs = [e.get("MESSAGE", "") for e in box.journal(PROXY)]
    assert any("admission: mode queue" in m for m in msgs), msgs[-5:]
    assert res["ok"] == res["sent"] and res["refused"] == 0 and res["e503"] == 0, res


def test_kv_server_frozen_past_its_watchdog_is_restarted_and_hits_resume(box):
    """The twin KV server keeps no worker registrations (its engines ping without an instance id): that the
    workers are back is shown by KV hits on the new server. Re-registration with the real ``lmcache server``
    after a restart: tests/real/test_stack_kv_restart.py."""
    old = set_keys(box, "kv_server", {"watchdog_s": KV_WATCHDOG_S})
    try:
        apply(box)                                       # the unit changed: pd-kvcache restarts with it
        assert f"WatchdogSec={KV_WATCHDOG_S:g}" in box.read("/etc/systemd/system/pd-kvcache.service")
        restart_sec = float(plan(box)["kv_server"]["restart_sec"])
        before = restarts(box, KV)
        load = Load(box, model(box), LOAD_RPS, 30.0)
        time.sleep(INJECT_AT)
        pid = engine_pid(box, KV)
        t0 = time.monotonic()
        box.run(["kill", "-STOP", str(pid)], check=True)
        box.wait_show(KV, timeout=KV_WATCHDOG_S * 3 + 30, ActiveState="active", NRestarts=str(before + 1))
        t_restarted = time.monotonic() - t0
        assert wait_until(lambda: curl(box, "http://127.0.0.1:6080/healthcheck")[0] == 200, 30)
        t_serving = time.monotonic() - t0
        res = load.result()
        # hits resumed: a shared prefix twice through the new (empty) server
        Load(box, model(box), LOAD_RPS, 3, prompts="shared").result()
        r0, h0 = kv_counters(box)
        after = Load(box, model(box), LOAD_RPS, 4, prompts="shared").result()
        r1, h1 = kv_counters(box)
    finally:
        box.write(CONF, old)
        apply(box)
    journal = [e.get("MESSAGE", "") for e in box.journal(KV)]
    bound = KV_WATCHDOG_S + restart_sec + 15.0
    rate = (h1 - h0) / (r1 - r0) if r1 > r0 else 0.0
    record(f"KV server SIGSTOP > WatchdogSec={KV_WATCHDOG_S:g}", res, t_serving,
           f"aborted by the watchdog and restarted after {t_restarted:.0f} s, serving after {t_serving:.0f} s; "
           f"shared-prefix KV hit rate after it {rate:.0%}; bound on any request {bound:g} s")
    assert any("Watchdog timeout" in m for m in journal), journal[-10:]
    # restarted by the watchdog (the journal line above, a state) within ~14 s; the bound is the wait's own
    # (KV_WATCHDOG_S x 3 + 30), as a bound on a hang, not on the machine's speed
    assert t_restarted < KV_WATCHDOG_S * 3 + 30, t_restarted
    assert "crashed" not in res and res["silent"] == 0 and res["done_after_error"] == 0, res
    assert res["refused"] == 0 and res["cut"] == 0, res
    assert res["max_s"] is not None and res["max_s"] < bound, f"a request waited {res['max_s']} s (> {bound:g} s)"
    assert after["ok"] == after["sent"] and r1 > r0 and rate > 0.3, (after, r0, r1, h0, h1)
