"""A settings change that touches every worker, applied under streaming load on the installed box (real systemd,
twin engines that take LOAD_S to load, as a GPU engine takes minutes): the rolling `pdctl apply` (one worker out
at a time, drained, canaried) against `pdctl apply --all-at-once` on the same box and load.

Counted per run: what the load's clients lost (every outcome but ok), and the most workers out of rotation at
once (drained, or a breaker not closed), from the proxy's status sampled while the apply runs.
"""
from __future__ import annotations

import json
import re
import threading
import time

import pytest

from .common import PDCTL, Load, curl, plan, proxy_status, wait_until

pytestmark = [pytest.mark.systemd, pytest.mark.slow]

LOAD_S = 20.0          # [twin] load_s: each restarted twin engine loads this long before it listens
RATE = 6.0             # req/s of streaming load (every 4th whole), 64-token answers
MAX_TOKENS = 64
ROLLOUT: dict = {}


WHY = ("name", "state", "drained", "opened_by", "last_error")


def slow_machine(b: dict) -> bool:
    """A breaker that the proxy's own checks opened on a worker the rollout did not touch because its engine
    answered too slowly: a /health probe that timed out, or the hung-worker detector. On this shared machine the twin
    engines go silent for seconds when its cores are busy (common.STALL_FLOOR_S says 8.6 s was seen), which is the
    machine's slowness, not the rollout's doing (a CI run saw a second worker out during the upgrade, nothing lost; a
    worker frozen 10 s with SIGSTOP mid-upgrade shows as opened_by "probe", "... gave no answer within 1 s"). A breaker
    opened by failed requests or a refused connection still counts as out."""
    err = b.get("last_error") or ""
    return (not b.get("drained") and b.get("state") != "closed"
            and (b.get("opened_by") == "stall" or (b.get("opened_by") == "probe" and "gave no answer within" in err)))


class OutWatch:
    """Samples the proxy's status twice a second: the most workers out of rotation at once (drained, or a
    breaker not closed, except those ``slow_machine`` explains: kept apart in ``slow``)."""

    def __init__(self, box):
        self.box, self.most, self.samples, self.seen = box, 0, 0, set()
        self.worst: list = []     # the backends out in the sample with the most out: what and why
        self.slow: list = []      # breakers opened by the machine's slowness (slow_machine), each time one is seen
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self) -> None:
        while not self.stop.is_set():
            st = proxy_status(self.box)
            if st:
                backends = st.get("backends", [])
                outb = [b for b in backends if (b.get("drained") or b.get("state") != "closed") and not slow_machine(b)]
                self.slow += [{k: b.get(k) for k in WHY} for b in backends if slow_machine(b)]
                if len(outb) > self.most:
                    self.worst = [{k: b.get(k) for k in WHY} for b in outb]
                self.most = max(self.most, len(outb))
                self.seen.update(b["name"] for b in outb)
                self.samples += 1
            time.sleep(0.5)

    def done(self) -> "OutWatch":
        self.stop.set()
        self.t.join(30)
        return self

    def report(self) -> dict:
        return {"most_out": self.most, "samples": self.samples, "worst": self.worst,
                "slow_machine": sorted({(b["name"], b["last_error"] or "") for b in self.slow})}


def model(box) -> str:
    p = plan(box)
    return p.get("served_model_name") or p["model"]


def ready(box) -> bool:
    return curl(box, "http://127.0.0.1:9001/ready")[0] == 200


def lost(res: dict) -> int:
    return sum(v for k, v in res.items() if k in ("e503", "stream_error", "silent", "cut", "refused", "garbled",
                                                   "other", "done_after_error"))


def apply_under_load(box, env: dict, load_s: float, *flags: str, verb: str = "apply") -> tuple:
    """(apply's output, load result, OutWatch, apply seconds): the load starts 3 s before the apply and runs
    ``load_s`` (past the apply's end, unless a slow machine makes the apply longer: then its end goes unloaded)."""
    print("BEFORE", json.dumps([{k: b.get(k) for k in WHY} for b in (proxy_status(box) or {}).get("backends", [])]))
    load = Load(box, model(box), RATE, load_s, max_tokens=MAX_TOKENS, check_text=True)
    time.sleep(3.0)
    watch = OutWatch(box)
    t0 = time.monotonic()
    r = box.run([PDCTL, verb, *flags], timeout=900, env=env)
    took = time.monotonic() - t0
    watch.done()
    res = load.result()
    assert "crashed" not in res, res
    res["load_s"] = load_s
    return r, res, watch, took


@pytest.fixture(scope="module")
def box(installed):
    assert wait_until(lambda: ready(installed), 120), "the appliance is not ready"
    yield installed
    # leave the box as the next modules expect it: engines that load at once, the default max_num_seqs
    r = installed.run([PDCTL, "apply", "--all-at-once"], timeout=600,
                      env={"PDCTL_TWIN_LOAD_S": "0", "PDCTL_PLAN_MAX_NUM_SEQS": "128"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert wait_until(lambda: ready(installed), 120)
    print("\nROLLOUT", json.dumps(ROLLOUT))


def test_rolling_apply_of_every_worker_loses_nothing_and_keeps_three_of_four_serving(box):
    workers = [w["instance"] for w in json.loads(box.read("/etc/pdctl/plan.json"))["workers"]]
    r, res, watch, took = apply_under_load(box, {"PDCTL_TWIN_LOAD_S": f"{LOAD_S:g}", "PDCTL_PLAN_MAX_NUM_SEQS": "96"},
                                           6 * LOAD_S + 40)
    out = r.stdout + r.stderr
    ROLLOUT["rolling"] = {"apply_s": round(took, 1), "sent": res["sent"], "ok": res["ok"], "lost": lost(res),
                          "migrated": res.get("migrated"), **watch.report()}
    print("ROLLING", json.dumps(ROLLOUT["rolling"]), "\n" + out[-4000:])
    assert r.returncode == 0, out[-4000:]
    for w in workers:      # each one drained, restarted, canaried, back: in order, with progress lines
        assert re.search(rf"\d/{len(workers)} {w}: draining|\d/{len(workers)} {w}: drained", out), (w, out[-3000:])
        assert re.search(rf"\d/{len(workers)} {w}: back in rotation after \d+ s", out), (w, out[-3000:])
    assert "waiting for the engine" in out                    # the 20 s load shows as progress, not silence
    argv = json.loads(box.read("/etc/pdctl/plan.json"))["workers"][0]["argv"]
    assert argv[argv.index("--max-num-seqs") + 1] == "96" and argv[argv.index("--load-s") + 1] == f"{LOAD_S:g}"
    assert watch.samples >= 10 and set(workers) <= watch.seen, (watch.seen, watch.samples)
    assert watch.most == 1, f"at most one worker out at a time: {watch.report()}"
    assert res["sent"] >= RATE * min(took, res["load_s"]) * 0.5, res       # the load ran through the apply
    assert lost(res) == 0 and res["e503"] == 0, f"clients lost requests during a rolling apply: {res}"
    st = proxy_status(box)
    assert st["requests"] and not any(b.get("drained") for b in st["backends"]), st["backends"]


def test_all_at_once_apply_is_what_the_rolling_one_saves(box):
    """The same kind of change, every worker restarted in one call: the box has no worker for LOAD_S."""
    r, res, watch, took = apply_under_load(box, {"PDCTL_PLAN_MAX_NUM_SEQS": "112"}, 3 * LOAD_S + 30,
                                           "--all-at-once")
    ROLLOUT["all_at_once"] = {"apply_s": round(took, 1), "sent": res["sent"], "ok": res["ok"], "lost": lost(res),
                              "e503": res["e503"], "stream_error": res["stream_error"], **watch.report()}
    print("ALL_AT_ONCE", json.dumps(ROLLOUT["all_at_once"]), "\n" + (r.stdout + r.stderr)[-2000:])
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert watch.most == 4, f"every worker restarts at once: {watch.report()}"
    assert lost(res) > 0 or res.get("max_s", 0) > LOAD_S, \
        f"a box without any worker for {LOAD_S:g} s cost the clients nothing? {res}"


def releases(box) -> dict:
    """Each worker's twin release, from its own /version."""
    out = {}
    for w in plan(box)["workers"]:
        code, body = curl(box, f"http://127.0.0.1:{w['port']}/version")
        out[w["instance"]] = json.loads(body).get("twin_version", "") if code == 200 else f"HTTP {code}"
    return out


def test_upgrade_moves_every_worker_to_the_new_release_losing_nothing(box):
    r, res, watch, took = apply_under_load(box, {}, 6 * LOAD_S + 40, "--engine-version", "twin-2", verb="upgrade")
    out = r.stdout + r.stderr
    ROLLOUT["upgrade"] = {"apply_s": round(took, 1), "sent": res["sent"], "lost": lost(res), **watch.report()}
    print("UPGRADE", json.dumps(ROLLOUT["upgrade"]), "\n" + out[-2500:])
    assert r.returncode == 0 and "upgraded to twin-2" in out, out[-3000:]
    assert set(releases(box).values()) == {"twin-2"}, releases(box)
    assert watch.most == 1 and lost(res) == 0, (watch.report(), res)
    rec = json.loads(box.read("/var/lib/pdctl/upgrade.json"))
    assert rec["outcome"] == "done" and rec["to"] == {"version": "twin-2"}, rec


def test_an_upgrade_whose_first_worker_fails_its_canary_rolls_back(box):
    """The new release's engines answer every generation with a 500 ([twin] fault http500): the first worker fails
    its canary, every file goes back, it restarts on the old release, and the clients never saw it."""
    r, res, watch, took = apply_under_load(box, {"PDCTL_TWIN_FAULT": "http500"}, 5 * LOAD_S + 40,
                                           "--engine-version", "twin-3", verb="upgrade")
    out = r.stdout + r.stderr
    ROLLOUT["upgrade_rolled_back"] = {"apply_s": round(took, 1), "sent": res["sent"], "lost": lost(res),
                                      "rc": r.returncode, **watch.report()}
    print("UPGRADE_ROLLED_BACK", json.dumps(ROLLOUT["upgrade_rolled_back"]), "\n" + out[-2500:])
    first = plan(box)["workers"][0]["instance"]
    assert r.returncode == 1, out[-3000:]
    assert "upgrade to twin-3 stopped" in out and f"{first} failed its canary" in out and "HTTP 500" in out, out[-3000:]
    assert f"rolled back: {first} run the previous settings" in out, out[-3000:]
    assert set(releases(box).values()) == {"twin-2"}, releases(box)
    toml = box.read("/etc/pdctl/pdctl.toml")
    assert 'version = "twin-2"' in toml and 'fault = ""' in toml, toml
    assert watch.most == 1 and lost(res) == 0, (watch.report(), res)
    assert json.loads(box.read("/var/lib/pdctl/upgrade.json"))["outcome"] == "rolled back"
    assert not any(b.get("drained") for b in proxy_status(box)["backends"])
