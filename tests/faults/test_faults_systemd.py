"""Break the installed appliance on purpose, one fault at a time, under steady load (2x the comfortable rate).

Runs under the real systemd (nspawn harness) after ``install.sh --simulate``: twin engines and the twin KV
server (the real ``lmcache server`` cannot serve twin engines; the real-engine suite exercises it).
For each fault: no silent 200 and no ``[DONE]`` after an error event; requests that fail before their
first byte are retried (proxy counter) or answered 503 with a reason; the unit comes back (systemd
restart, NRestarts+1 where it died) and the proxy re-admits it within 10 s of it being healthy;
``pdctl status --json`` shows the fault while it lasts. The table is printed and kept in FAULT_TABLE.
"""
from __future__ import annotations

import json
import threading
import time

import pytest

from .common import (LOAD_RPS, STALL_FLOOR_S, Load, backend, backend_state, curl, engine_pid, kv_counters, main_pid,
                     pdctl_status, plan, proxy_status, restarts, set_fault, settled, unit_of, wait_until, worker)

pytestmark = [pytest.mark.systemd, pytest.mark.slow]

LOAD_S = 16.0        # seconds of load per fault (covers a restart: RestartSec 5 s + engine start)
ANSWER_TOKENS = 64   # long enough that a failure lands mid-stream (the first round used 16)
STALL_BOUND_S = STALL_FLOOR_S  # the box's [proxy] stall_floor_s: a hung decoder's streams move after this silence
INJECT_AT = 2.0      # the fault lands this long after the load starts
HANG_AT_TOKEN = 8    # the hung decoder hangs once one of its answers has sent this many tokens (of ANSWER_TOKENS)
HANG_S = 45.0        # the hung decoder's hang: far past the stall bound, so a stream that waited it out is plain
READMIT_S = 30.0     # healthy -> re-admitted within this (0.7-1.8 s measured): a re-admission that waits out
                     # a long cool-down fails, a busy machine's probe delays do not
FAULT_TABLE: list = []
READMIT: dict = {}  # fault -> (s from healthy to re-admitted, proxy trail)
TRAILS: dict = {}
KV_AFTER: dict = {}   # instance -> the proxy's view of it between healthy and re-admitted


class StatusWatch:
    """Polls ``pdctl status --json`` while a fault lasts; remembers the first snapshot that names it."""

    def __init__(self, box, needles: tuple):
        self.box, self.needles, self.seen, self.samples = box, needles, None, 0
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self) -> None:
        while not self.stop.is_set() and self.seen is None:
            snap = pdctl_status(self.box)
            self.samples += 1
            if snap and snap.get("overall") != "ready":
                why = " ".join(snap.get("overall_reasons", []))
                if any(n in why for n in self.needles):
                    self.seen = f"{snap['overall']}: {why}"[:300]

    def done(self) -> str | None:
        self.stop.set()
        self.t.join(40)
        return self.seen


def model(box) -> str:
    p = plan(box)
    return p.get("served_model_name") or p["model"]


def wait_healthy_and_admitted(box, instance: str, timeout: float = 90.0) -> tuple:
    """(t healthy, t re-admitted) monotonic: engine /health 200 and its unit active, then breaker closed."""
    port = worker(box, instance)["port"]
    unit = unit_of(instance)
    deadline = time.monotonic() + timeout
    t_h = None
    trail = []
    while time.monotonic() < deadline:
        if t_h is None:
            if box.show(unit, "ActiveState")["ActiveState"] == "active" and \
                    curl(box, f"http://127.0.0.1:{port}/health")[0] == 200:
                t_h = time.monotonic()
        if t_h is not None:
            b = backend(box, instance) or {}
            key = (b.get("state"), b.get("opened_by"), b.get("last_error", "")[:120])
            if not trail or trail[-1][1:] != key:
                trail.append((round(time.monotonic() - t_h, 1), *key))
            if b.get("state") == "closed":
                TRAILS[instance] = trail
                return t_h, time.monotonic()
        time.sleep(0.2)
    raise AssertionError(f"{instance}: healthy at {t_h}, not re-admitted within {timeout} s; proxy trail {trail}")


def check_invariants(name: str, res: dict, cuts_allowed: bool = False) -> None:
    assert "crashed" not in res, f"{name}: load client failed: {res}"
    assert res["silent"] == 0, f"{name}: silent cuts (200 without [DONE] or error event): {res}"
    assert res["garbled"] == 0, f"{name}: answers with repeated or lost text: {res}"
    if not cuts_allowed:
        assert res["cut"] == 0, f"{name}: the proxy is alive, so a broken stream must end with an error event: {res}"
    assert res["done_after_error"] == 0, f"{name}: [DONE] after an error event: {res}"


def record(name, res, recover_s, status_seen, note="") -> None:
    row = {"fault": name, "sent": res["sent"], "ok": res["ok"], "retried": res["retried"],
           "migrated": res.get("migrated"), "503": res["e503"],
           "stream_errors": res["stream_error"], "cut": res["cut"], "refused": res.get("refused"),
           "garbled": res.get("garbled"), "other": res["other"],
           "silent": res["silent"],
           "recover_s": None if recover_s is None else round(recover_s, 1), "status_shows": bool(status_seen),
           "max_latency_s": res.get("max_s"), "note": note}
    FAULT_TABLE.append(row)
    print("FAULT", json.dumps(row), "examples", json.dumps(res.get("examples", {}))[:600])


@pytest.fixture(scope="module")
def box(installed):
    # the whole appliance healthy and admitted before the first fault
    for w in plan(installed)["workers"]:
        wait_healthy_and_admitted(installed, w["instance"], timeout=60)
    return installed


def kill_engine(box, instance: str, name: str) -> None:
    unit = unit_of(instance)
    before = restarts(box, unit)
    load = Load(box, model(box), LOAD_RPS, LOAD_S, max_tokens=ANSWER_TOKENS, check_text=True)
    time.sleep(INJECT_AT)
    watch = StatusWatch(box, (instance, unit))
    pid = engine_pid(box, unit)
    t0 = time.monotonic()
    box.run(["kill", "-9", str(pid)], check=True)
    box.wait_show(unit, timeout=60, ActiveState="active", NRestarts=str(before + 1))
    t_h, t_adm = wait_healthy_and_admitted(box, instance)
    seen = watch.done()
    res = load.result()
    record(name, res, t_adm - t0, seen, f"re-admitted {t_adm - t_h:.1f} s after healthy")
    check_invariants(name, res)
    READMIT[name] = (round(t_adm - t_h, 1), TRAILS[instance])
    assert seen, f"{name}: pdctl status never showed {instance} degraded"
    return res


def proxy_decisions(box) -> dict:
    r = box.run(["curl", "-sf", "http://127.0.0.1:9001/pdctl/status"], timeout=10)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout).get("decisions", {})


def test_kill9_decoder_engine(box):
    res = kill_engine(box, "decode-0", "kill -9 decoder engine")
    # its streams continue on the other decoders, its first-byte waits are retried there: no client sees it
    assert res["ok"] == res["sent"], res
    assert res["migrated"] > 0, res


def test_kill9_prefiller_engine(box):
    before = proxy_decisions(box)
    res = kill_engine(box, "prefill-0", "kill -9 prefiller engine (the only one)")
    # soft roles: with the only prefiller gone the adaptive policy aggregates on a decoder (which prefills the
    # prompt itself) instead of answering 503; the first round's pdctl policy answered 52 of 128 with a 503
    assert res["ok"] == res["sent"], res
    after = proxy_decisions(box)
    assert after.get("aggregate", {}).get("no_prefiller", 0) > before.get("aggregate", {}).get("no_prefiller", 0)


def test_kill9_kv_server(box):
    unit = "pd-kvcache.service"
    before = restarts(box, unit)
    Load(box, model(box), LOAD_RPS, 3, prompts="shared").result()    # the proxy now knows the shared prefix
    rb, hb = kv_counters(box)
    Load(box, model(box), LOAD_RPS, 3).result()                      # baseline hit rate, new prompts
    ra, ha = kv_counters(box)
    base = (ha - hb) / (ra - rb) if ra > rb else 0.0
    load = Load(box, model(box), LOAD_RPS, LOAD_S)
    time.sleep(INJECT_AT)
    watch = StatusWatch(box, ("kv server", unit))
    pid = engine_pid(box, unit)
    t0 = time.monotonic()
    box.run(["kill", "-9", str(pid)], check=True)
    box.wait_show(unit, timeout=60, ActiveState="active", NRestarts=str(before + 1))
    t_up = wait_until(lambda: curl(box, "http://127.0.0.1:6080/healthcheck")[0] == 200, 30)
    assert t_up
    t_up = time.monotonic()
    seen = watch.done()
    res = load.result()
    # workers reconnect: the prefiller stores into the new server, the decoders load from it; counted once the
    # proxy's own KV warm-ups (pure misses on a producer) are over
    assert settled(box), f"backends not all admitted and KV-warmed 120 s after the restart: {proxy_status(box)}"
    r0, h0 = kv_counters(box)
    p0 = proxy_status(box) or {}
    after = Load(box, model(box), LOAD_RPS, 4).result()
    r1, h1 = kv_counters(box)
    p1 = proxy_status(box) or {}
    why = {k: _delta(p0.get(k), p1.get(k)) for k in ("pd_skipped", "kv_wait", "decisions")}
    hit_rate = (h1 - h0) / (r1 - r0) if r1 > r0 else 0.0
    # the shared prefix the proxy saw before the restart: does it take the P leg again (KV is empty now)?
    after_s = Load(box, model(box), LOAD_RPS, 3, prompts="shared").result()
    r2, h2 = kv_counters(box)
    KV_AFTER["shared_prefix_hit_rate"] = (h2 - h1) / (r2 - r1) if r2 > r1 else 0.0
    shared = KV_AFTER["shared_prefix_hit_rate"]
    record("kill -9 KV server", res, t_up - t0, seen,
           f"KV hit rate {base:.0%} before, {hit_rate:.0%} after restart (new prompts), {shared:.0%} (prefix "
           "seen before the restart)")
    check_invariants("kill -9 KV server", res)
    assert after["ok"] == after["sent"] and after_s["ok"] == after_s["sent"], (after, after_s)
    # unique prompts: the P leg's lookup misses by design, the D leg's hits: the ceiling is 50 %
    assert base > 0.3 and r1 > r0 and hit_rate >= 0.9 * base, \
        f"KV hit rate did not recover: {hit_rate:.2f} vs {base:.2f} before ({r0}->{r1}, {h0}->{h1}); proxy: {why}"
    assert seen, "pdctl status never showed the KV server fault"


def _delta(before, after):
    """What a proxy counter (a number or a nested dict of them) gained in a window."""
    if isinstance(after, dict):
        before = before if isinstance(before, dict) else {}
        return {k: d for k, v in after.items() if (d := _delta(before.get(k), v))}
    return after - before if isinstance(after, (int, float)) and isinstance(before, (int, float)) else after


def test_kv_restart_shared_prefix_hit_rate_recovers(box):
    """A prefix the proxy saw stored before the KV restart: it must take the P leg again (the L1 is empty),
    so the decoders hit instead of recomputing (LMCache issue 4642's other half)."""
    assert "shared_prefix_hit_rate" in KV_AFTER, "the KV server fault did not run"
    assert KV_AFTER["shared_prefix_hit_rate"] > 0.3, KV_AFTER


def test_kill9_proxy(box):
    unit = "pd-proxy.service"
    before = restarts(box, unit)
    load = Load(box, model(box), LOAD_RPS, LOAD_S)
    time.sleep(INJECT_AT)
    watch = StatusWatch(box, ("proxy",))
    t0 = time.monotonic()
    box.run(["kill", "-9", str(main_pid(box, unit))], check=True)
    box.wait_show(unit, timeout=60, ActiveState="active", NRestarts=str(before + 1))
    t_ready = wait_until(lambda: curl(box, "http://127.0.0.1:9000/ready")[0] == 200, 30)
    assert t_ready, "proxy not ready again within 30 s"
    recover = time.monotonic() - t0
    seen = watch.done()
    res = load.result()
    record("kill -9 proxy", res, recover, seen,
           "what the killed process held is cut (the client raises, never a silent 200); new connections wait "
           "in pd-proxy.socket's backlog (0 refused)" + ("" if seen else "; the ~2 s restart fell between two "
                                                          "status polls"))
    check_invariants("kill -9 proxy", res, cuts_allowed=True)
    assert res.get("refused", 0) == 0 and res["other"] == 0, res     # the socket outlives the process
    # with socket activation the proxy is gone for ~2 s and clients wait rather than fail, so a status poll
    # may miss it; the restart itself is asserted above (NRestarts + 1, /ready again)


def test_systemctl_stop_decoder(box):
    inst, unit = "decode-1", unit_of("decode-1")
    load = Load(box, model(box), LOAD_RPS, LOAD_S, max_tokens=ANSWER_TOKENS, check_text=True)
    time.sleep(INJECT_AT)
    watch = StatusWatch(box, (inst, unit))
    box.systemctl("stop", unit, check=True, timeout=90)
    assert wait_until(lambda: backend_state(box, inst) in ("open", "half_open"), 30), "proxy did not eject it"
    time.sleep(2.0)
    t0 = time.monotonic()
    box.systemctl("start", unit, check=True, timeout=120)
    t_h, t_adm = wait_healthy_and_admitted(box, inst)
    seen = watch.done()
    res = load.result()
    record("systemctl stop decoder", res, t_adm - t0, seen, f"time from start; re-admitted {t_adm - t_h:.1f} s "
                                                             "after healthy")
    check_invariants("systemctl stop decoder", res)
    assert res["ok"] == res["sent"], f"a graceful stop must lose nothing (2 more decoders): {res}"
    READMIT["systemctl stop decoder"] = (round(t_adm - t_h, 1), TRAILS[inst])
    assert seen


def fault_mode(box, inst: str) -> str | None:
    port = worker(box, inst)["port"]
    code, body = curl(box, f"http://127.0.0.1:{port}/twin/fault", max_s=10, timeout=20)
    return json.loads(body).get("mode") if code == 200 else None


def hang_mid_stream(box, inst: str, within: float) -> None:
    """Arm ``inst`` to hang the moment one of its answers has sent HANG_AT_TOKEN tokens (the twin's
    ``hang_mid_stream`` fault), and wait for it to fire: the hang then freezes at least that stream mid-answer, so
    it must be moved. Sampling "is a stream open?" and then hanging lost the race on a starved CI machine (the
    status and fault calls took longer than the streams: no stream seen open in 14 s of load)."""
    set_fault(box, inst, "hang_mid_stream", HANG_AT_TOKEN)
    fired = wait_until(lambda: fault_mode(box, inst) == "hang", within)
    if not fired:
        set_fault(box, inst, "none")      # disarmed: the rows after this one get a healthy box
    assert fired, f"{inst}: no answer of its reached token {HANG_AT_TOKEN} within {within:g} s of load " \
                  f"(proxy's view: {backend(box, inst)})"


def injected(box, inst: str, mode: str, arg=None, lasts: float = 5.0) -> tuple:
    """Run load, inject ``mode`` on ``inst`` for ``lasts`` s, clear it; -> (result, recover s, status seen)."""
    load = Load(box, model(box), LOAD_RPS, LOAD_S, max_tokens=ANSWER_TOKENS, check_text=True)
    time.sleep(INJECT_AT)
    watch = StatusWatch(box, (inst,))
    if mode == "hang":
        hang_mid_stream(box, inst, within=LOAD_S - INJECT_AT)
    else:
        set_fault(box, inst, mode, arg)
    time.sleep(lasts)
    seen_during = watch.done()
    t0 = time.monotonic()
    set_fault(box, inst, "none")
    t_h, t_adm = wait_healthy_and_admitted(box, inst, timeout=60)
    res = load.result()
    return res, t_adm - t0, seen_during, t_adm - t_h


def test_hung_decoder(box):
    res, rec, seen, adm = injected(box, "decode-2", "hang", lasts=HANG_S)
    record(f"hung decoder ({HANG_S:g} s)", res, rec, seen, f"its streams moved after {STALL_BOUND_S:g} s of silence "
           "(stall bound), its first-byte waits when its breaker opened; recover = fault cleared -> re-admitted")
    check_invariants("hung decoder", res)
    assert res["ok"] == res["sent"], res
    assert res["migrated"] > 0, res
    # a request waits at most the stall bound plus the time to continue it (~8 s), not the 30 s hang: 20 s tells
    # the two apart on a busy machine (the 8 s hang this used to be left 3 s between them)
    assert res["max_s"] < STALL_BOUND_S + 15.0, res
    READMIT["hung decoder"] = (round(adm, 1), TRAILS["decode-2"])
    assert seen, "pdctl status never showed the hung decoder"


def test_decoder_answering_500(box):
    res, rec, seen, adm = injected(box, "decode-0", "http500", lasts=5.0)
    record("decoder answers HTTP 500", res, rec, seen, "retried on the other decoders")
    check_invariants("decoder answers HTTP 500", res)
    assert res["retried"] and res["retried"] > 0, res
    assert res["ok"] == res["sent"], res      # before the first byte: retried elsewhere


def test_decoder_dies_mid_stream(box):
    res, rec, seen, adm = injected(box, "decode-1", "die_mid_stream", 20, lasts=5.0)
    record("decoder dies mid-stream", res, rec, seen, "each stream cut after 20 tokens continued on another "
           "decoder from its token ids")
    check_invariants("decoder dies mid-stream", res)
    assert res["migrated"] > 0, res
    assert res["ok"] == res["sent"], res


def test_readmitted_within_30s_of_healthy(box):
    assert READMIT, "no restart was measured"
    slow = {k: v for k, v in READMIT.items() if v[0] > READMIT_S}
    assert not slow, slow


def test_zz_print_fault_table(box):
    from .table import render
    assert FAULT_TABLE, "no fault ran"
    print("\n" + render(FAULT_TABLE))
