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


class OutWatch:
    """Samples the proxy's status twice a second: the most workers out of rotation at once."""

    def __init__(self, box):
        self.box, self.most, self.samples, self.seen = box, 0, 0, set()
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self) -> None:
        while not self.stop.is_set():
            st = proxy_status(self.box)
            if st:
                out = [b["name"] for b in st.get("backends", []) if b.get("drained") or b.get("state") != "closed"]
                self.most = max(self.most, len(out))
                self.seen.update(out)
                self.samples += 1
            time.sleep(0.5)

    def done(self) -> "OutWatch":
        self.stop.set()
        self.t.join(30)
        return self


def model(box) -> str:
    p = plan(box)
    return p.get("served_model_name") or p["model"]


def ready(box) -> bool:
    return curl(box, "http://127.0.0.1:9001/ready")[0] == 200


def lost(res: dict) -> int:
    return sum(v for k, v in res.items() if k in ("e503", "stream_error", "silent", "cut", "refused", "garbled",
                                                   "other", "done_after_error"))


def apply_under_load(box, env: dict, load_s: float, *flags: str) -> tuple:
    """(apply's output, load result, OutWatch, apply seconds): the load starts 3 s before the apply and runs
    ``load_s`` (past the apply's end, unless a slow machine makes the apply longer: then its end goes unloaded)."""
    load = Load(box, model(box), RATE, load_s, max_tokens=MAX_TOKENS, check_text=True)
    time.sleep(3.0)
    watch = OutWatch(box)
    t0 = time.monotonic()
    r = box.run([PDCTL, "apply", *flags], timeout=900, env=env)
    took = time.monotonic() - t0
    watch.done()
    res = load.result()
    assert "crashed" not in res, res
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
                                           8 * LOAD_S + 60)
    out = r.stdout + r.stderr
    ROLLOUT["rolling"] = {"apply_s": round(took, 1), "sent": res["sent"], "ok": res["ok"], "lost": lost(res),
                          "migrated": res.get("migrated"), "most_out": watch.most, "samples": watch.samples}
    print("ROLLING", json.dumps(ROLLOUT["rolling"]), "\n" + out[-4000:])
    assert r.returncode == 0, out[-4000:]
    for w in workers:      # each one drained, restarted, canaried, back: in order, with progress lines
        assert re.search(rf"\d/{len(workers)} {w}: draining|\d/{len(workers)} {w}: drained", out), (w, out[-3000:])
        assert re.search(rf"\d/{len(workers)} {w}: back in rotation after \d+ s", out), (w, out[-3000:])
    assert "waiting for the engine" in out                    # the 20 s load shows as progress, not silence
    argv = json.loads(box.read("/etc/pdctl/plan.json"))["workers"][0]["argv"]
    assert argv[argv.index("--max-num-seqs") + 1] == "96" and argv[argv.index("--load-s") + 1] == f"{LOAD_S:g}"
    assert watch.samples >= 10 and set(workers) <= watch.seen, (watch.seen, watch.samples)
    assert watch.most == 1, f"at most one worker out at a time: {watch.most}"
    assert res["sent"] >= RATE * took * 0.5, res
    assert lost(res) == 0 and res["e503"] == 0, f"clients lost requests during a rolling apply: {res}"
    st = proxy_status(box)
    assert st["requests"] and not any(b.get("drained") for b in st["backends"]), st["backends"]


def test_all_at_once_apply_is_what_the_rolling_one_saves(box):
    """The same kind of change, every worker restarted in one call: the box has no worker for LOAD_S."""
    r, res, watch, took = apply_under_load(box, {"PDCTL_PLAN_MAX_NUM_SEQS": "112"}, 3 * LOAD_S + 30,
                                           "--all-at-once")
    ROLLOUT["all_at_once"] = {"apply_s": round(took, 1), "sent": res["sent"], "ok": res["ok"], "lost": lost(res),
                              "e503": res["e503"], "stream_error": res["stream_error"], "most_out": watch.most,
                              "samples": watch.samples}
    print("ALL_AT_ONCE", json.dumps(ROLLOUT["all_at_once"]), "\n" + (r.stdout + r.stderr)[-2000:])
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert watch.most == 4, f"every worker restarts at once: {watch.most} seen out together"
    assert lost(res) > 0 or res.get("max_s", 0) > LOAD_S, \
        f"a box without any worker for {LOAD_S:g} s cost the clients nothing? {res}"
