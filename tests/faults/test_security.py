"""Security review as tests, inside the harness after ``install.sh --simulate``: nobody gets in.

- every listening socket of the appliance except the proxy's public port is bound to loopback;
- the KV server's HTTP admin API is unreachable from a non-loopback address (the proxy is, as a control);
- the optional API key on the public port: 401 without it, /health open; named keys (``pdctl keys``) in force
  at once through ``systemctl reload``, a revoked one refused on its next request;
- TLS on the public port by ``pdctl apply``, its certificate renewed by ``systemctl reload`` under load;
- env files 0600 root, every unit and every process runs as ``pdctl``;
- ``systemd-analyze security`` <= 3.0 for every installed unit;
- no config value is ever interpolated into a shell (units use argv; no shell in appliance/ subprocess calls).
"""
from __future__ import annotations

import ast
import json
import re
import time
from pathlib import Path

import pytest

from appliance import constants as C

from .common import REPO, VENV_PY, curl, plan, wait_until

pytestmark = [pytest.mark.systemd]
PROXY_PORT = 9000
OUTSIDE = "10.213.7.1"     # a non-127/8 address we add inside the container's private netns


def pd_units(box) -> list:
    p = plan(box)
    return ["pd-kvcache.service", "pd-proxy.service"] + [f"pd-worker@{w['instance']}.service" for w in p["workers"]]


def pd_pids(box) -> dict:
    """pid -> unit for every process in a pd-* unit's cgroup."""
    out = {}
    for u in pd_units(box):
        r = box.run(["systemctl", "show", u, "-p", "ControlGroup", "--value"])
        cg = r.stdout.strip()
        if not cg:
            continue
        for f in ("cgroup.procs",):
            for base in ("/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
                rr = box.run(["cat", f"{base}{cg}/{f}"])
                if rr.returncode == 0 and rr.stdout.strip():
                    for pid in rr.stdout.split():
                        out[int(pid)] = u
                    break
    return out


def test_listeners_loopback_except_proxy(installed):
    pids = pd_pids(installed)
    assert len(pids) >= len(pd_units(installed)), pids
    r = installed.run(["ss", "-ltnpH"], check=True)
    seen = []
    for ln in r.stdout.splitlines():
        cols = ln.split()
        local = cols[3]
        owners = [int(p) for p in re.findall(r"pid=(\d+)", ln)]
        ours = [pids[p] for p in owners if p in pids]
        if not ours:
            continue
        host, _, port = local.rpartition(":")
        seen.append((ours[0], host, int(port)))
        if int(port) == PROXY_PORT:
            continue
        assert host in ("127.0.0.1", "[::1]"), f"{ours[0]} listens on {local}: only :{PROXY_PORT} may leave loopback"
    units = {u for u, _, _ in seen}
    assert "pd-kvcache.service" in units and "pd-proxy.service" in units, seen
    assert any(u.startswith("pd-worker@") for u in units), seen


@pytest.fixture(scope="module")
def outside_addr(installed):
    """A host address outside 127.0.0.0/8 (what a LAN peer would dial), in the container's private netns.

    It sits on ``lo`` (no dummy/veth module needed): a socket bound to 127.0.0.1 does not accept
    connections addressed to it, one bound to 0.0.0.0 does; the KV unit's IPAddressDeny also refuses it.
    """
    installed.run(["ip", "addr", "add", f"{OUTSIDE}/32", "dev", "lo"], check=True)
    yield OUTSIDE
    installed.run(["ip", "addr", "del", f"{OUTSIDE}/32", "dev", "lo"])


def test_kv_admin_api_unreachable_from_outside_loopback(installed, outside_addr):
    p = plan(installed)
    kv = p["kv_server"]
    code, _ = curl(installed, f"http://{outside_addr}:{PROXY_PORT}/health")
    assert code == 200, "control: the proxy must answer on the non-loopback address"
    for port in (kv["http_port"], kv["zmq_port"], p["proxy"]["internal_port"], p["workers"][0]["port"]):
        code, body = curl(installed, f"http://{outside_addr}:{port}/healthcheck")
        assert code == 0, f"port {port} answered HTTP {code} on {outside_addr}: {body[:200]}"
    code, _ = curl(installed, f"http://127.0.0.1:{kv['http_port']}/healthcheck")
    assert code == 200, "control: the KV server answers on loopback"


def test_env_files_0600_root(installed):
    r = installed.sh("find /etc/pdctl -name '*.env' -printf '%m %u %g %p\\n'", check=True)
    lines = r.stdout.splitlines()
    assert any("/workers/" in ln for ln in lines) and any("kvcache.env" in ln for ln in lines), lines
    for ln in lines:
        mode, user, group, path = ln.split(" ", 3)
        assert mode == "600" and user == "root" and group == "root", ln


def test_units_and_processes_run_as_pdctl(installed):
    for u in pd_units(installed):
        got = installed.show(u, "User", "Group", "ActiveState")
        assert got["User"] == "pdctl" and got["Group"] == "pdctl" and got["ActiveState"] == "active", (u, got)
    pids = pd_pids(installed)
    r = installed.run(["ps", "-o", "pid=,user=", "-p", ",".join(map(str, pids))], check=True)
    users = {int(a): b for a, b in (ln.split() for ln in r.stdout.splitlines())}
    assert set(users) == set(pids) and set(users.values()) == {"pdctl"}, users


def test_every_engine_keeps_its_compile_caches_in_the_units_cache_directory(installed):
    """A worker's engine caches what it compiles (vLLM's artifacts, torch inductor's and Triton's kernels) under the
    unit's CacheDirectory, which outlives a restart; torch's default is $TMPDIR, the unit's private /tmp, which
    every restart (a rollout, a crash) empties, so the next start would compile again."""
    workers = {p: u for p, u in pd_pids(installed).items() if u.startswith("pd-worker@")}
    units = {f"pd-worker@{w['instance']}.service" for w in plan(installed)["workers"]}
    assert workers and set(workers.values()) == units, (workers, units)
    read = set()
    for pid, unit in workers.items():
        r = installed.run(["cat", f"/proc/{pid}/environ"])
        if r.returncode != 0:
            continue              # a short-lived helper process gone meanwhile
        read.add(unit)
        env = dict(kv.split("=", 1) for kv in r.stdout.split("\0") if "=" in kv)
        for k in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"):
            assert env.get(k, "").startswith(f"{C.CACHE_DIR}/"), (unit, pid, k, env.get(k))
    assert read == set(workers.values()), (read, workers)     # every worker's processes, the engine among them


def test_systemd_analyze_security_every_unit(installed):
    scores = {}
    for u in pd_units(installed):
        r = installed.run(["systemd-analyze", "security", u, "--no-pager"], timeout=60)
        line = [ln for ln in r.stdout.splitlines() if "Overall exposure level" in ln][0]
        scores[u] = float(line.split(":")[1].split()[0])
    print("systemd-analyze security", scores)
    assert all(s <= 3.0 for s in scores.values()), scores


def test_installed_units_use_argv_not_a_shell(installed):
    text = ""
    for u in ["pd.target", "pd-kvcache.service", "pd-proxy.service", "pd-worker@.service"]:
        text += installed.read(f"/etc/systemd/system/{u}")
    execs = [ln.split("=", 1)[1] for ln in text.splitlines() if re.match(r"Exec\w+=", ln)]
    assert execs
    for e in execs:
        first = e.lstrip("-@:+!").split()[0]
        assert first.startswith("/") and Path(first).name not in ("sh", "bash", "dash", "env"), e
        assert "$(" not in e and "`" not in e and " -c " not in f" {e} ", e


def _shell_calls(path: Path) -> list:
    """subprocess/os calls in one module that would run a shell."""
    bad = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = ast.unparse(node.func)
        if fn in ("os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput"):
            bad.append(f"{path}:{node.lineno}: {fn}")
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                bad.append(f"{path}:{node.lineno}: shell={ast.unparse(kw.value)}")
        if node.args and isinstance(node.args[0], (ast.List, ast.Tuple)) and len(node.args[0].elts) >= 2:
            a, b = node.args[0].elts[:2]
            if isinstance(a, ast.Constant) and isinstance(b, ast.Constant) and \
                    str(a.value).rsplit("/", 1)[-1] in ("sh", "bash", "dash") and b.value == "-c":
                bad.append(f"{path}:{node.lineno}: {a.value} -c")
    return bad


def test_no_shell_anywhere_in_appliance_or_unit_templates():
    bad = []
    for p in sorted((REPO / "appliance").rglob("*.py")):
        bad += _shell_calls(p)
    for p in sorted((REPO / "units").glob("*.in")):
        for n, ln in enumerate(p.read_text().splitlines(), 1):
            if re.match(r"Exec\w+=", ln) and re.search(r"\b(ba|da)?sh\s+-c\b|\$\(|`", ln):
                bad.append(f"{p}:{n}: {ln}")
    assert bad == [], "a config value could reach a shell:\n" + "\n".join(bad)


# --- the optional API key ---------------------------------------------------------------------------
KEY = "pdctl-test-key-6c1f"


def _guarded(box) -> tuple:
    """(status without a key, status with it, /health status) on the public port."""
    no = curl(box, f"http://127.0.0.1:{PROXY_PORT}/v1/models")[0]
    yes = curl(box, f"http://127.0.0.1:{PROXY_PORT}/v1/models", "-H", f"Authorization: Bearer {KEY}")[0]
    health = curl(box, f"http://127.0.0.1:{PROXY_PORT}/health")[0]
    return no, yes, health


def _restart_proxy(box) -> None:
    box.systemctl("daemon-reload", check=True)
    box.systemctl("restart", "pd-proxy.service", check=True, timeout=90)
    assert wait_until(lambda: curl(box, f"http://127.0.0.1:{PROXY_PORT}/health")[0] == 200, 30)


def test_api_key_through_the_proxy_unit(installed):
    """The key file on the proxy's argv (a unit drop-in): 401 without it, 200 with it, /health open."""
    box = installed
    box.write("/etc/pdctl/api.key", KEY + "\n", mode=0o640)
    box.run(["chgrp", "pdctl", "/etc/pdctl/api.key"], check=True)
    exec_start = [ln for ln in box.read("/etc/systemd/system/pd-proxy.service").splitlines()
                  if ln.startswith("ExecStart=")][0]
    dropin = "/etc/systemd/system/pd-proxy.service.d/50-api-key.conf"
    box.write(dropin, f"[Service]\nExecStart=\n{exec_start} --api-key-file /etc/pdctl/api.key\n")
    try:
        _restart_proxy(box)
        no, yes, health = _guarded(box)
        assert (no, yes, health) == (401, 200, 200)
        code, body = curl(box, f"http://127.0.0.1:{PROXY_PORT}/v1/completions", "-X", "POST", "-d", "{}")
        assert code == 401 and "Bearer" in body, body
    finally:
        box.run(["rm", "-rf", "/etc/systemd/system/pd-proxy.service.d"])
        _restart_proxy(box)
    assert _guarded(box)[0] == 200, "the key must be gone with the drop-in"


def _status(box, path: str, key: str = "") -> tuple:
    extra = ("-H", f"Authorization: Bearer {key}") if key else ()
    return curl(box, f"http://127.0.0.1:{PROXY_PORT}{path}", *extra)


def test_named_keys_with_pdctl_keys_and_systemctl_reload(installed):
    """``pdctl keys add`` before the file is in force, ``[proxy] keys_file`` + ``pdctl apply``; then a key added
    or revoked while the proxy runs is in force at once (``pdctl keys`` reloads pd-proxy through systemd, which
    the proxy's journal shows), /health stays open, a key of another box is refused."""
    box = installed
    pdctl = "/usr/local/bin/pdctl"
    r = box.run([pdctl, "keys", "add", "app", "--file", "/etc/pdctl/keys.toml"], timeout=60)
    assert r.returncode == 0, r.stderr
    app = r.stdout.strip()
    assert "not the proxy's [proxy] keys_file" in r.stderr
    st = box.run(["stat", "-c", "%a %U", "/etc/pdctl/keys.toml"], check=True).stdout.split()
    assert st == ["600", "pdctl"], st                 # the proxy (user pdctl) reads it, nobody else
    cfg = box.read("/etc/pdctl/pdctl.toml")
    new = re.sub(r'(?m)^keys_file\s*=.*$', 'keys_file = "/etc/pdctl/keys.toml"', cfg)
    assert new != cfg, "pdctl.toml has no keys_file line (config template)"
    box.write("/etc/pdctl/pdctl.toml", new)
    try:
        r = box.run([pdctl, "apply"], timeout=300)
        assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-1500:]
        assert wait_until(lambda: _status(box, "/v1/models", app)[0] == 200, 30), _status(box, "/v1/models", app)
        assert _status(box, "/v1/models")[0] == 401 and _status(box, "/health")[0] == 200
        code, body = _status(box, "/v1/models", "sk-pd-" + "x" * 43)
        assert code == 401 and "wrong API key" in body, body
        r = box.run([pdctl, "keys", "add", "second", "--rpm", "100"], timeout=90)
        assert r.returncode == 0 and "pd-proxy.service reloaded" in r.stderr, r.stderr
        second = r.stdout.strip()
        assert _status(box, "/v1/models", second)[0] == 200              # in force without a restart
        r = box.run([pdctl, "keys", "revoke", "app"], timeout=90)
        assert r.returncode == 0 and "reloaded" in r.stderr, r.stderr
        code, body = _status(box, "/v1/models", app)
        assert code == 401 and "revoked_api_key" in body, body
        listing = box.run([pdctl, "keys", "list"], check=True).stdout
        assert "revoked" in listing and app not in listing and second not in listing
        st = box.run([pdctl, "status", "--keys"], timeout=60)       # use now, beside class and limits
        assert st.returncode == 0, st.stdout + st.stderr
        row = {ln.split()[0]: ln.split() for ln in st.stdout.splitlines() if ln.split()}
        assert row["app"][2] == "revoked" and row["second"][1:3] == ["interactive", "active"], st.stdout
        assert row["second"][4].endswith("/100"), st.stdout          # requests this minute / its rpm limit
        assert app not in st.stdout and second not in st.stdout
        journal = box.run(["journalctl", "-u", "pd-proxy.service", "--no-pager", "-n", "200"]).stdout
        assert "API keys re-read" in journal, journal[-1500:]
        # the audit trail: one structured entry per request (the proxy, as user pdctl, writes to journald),
        # one per key change; `pdctl logs --audit --key` reads them by field
        def audit(*more):
            return box.run([pdctl, "logs", "--audit", *more, "-n", "500"], timeout=30).stdout
        assert wait_until(lambda: "audit app GET models 401 revoked_api_key" in audit("--key", "app"), 30), audit()
        assert "audit second GET models 200" in audit("--key", "second"), audit()
        mine = audit("--key", "app")
        assert "audit app GET models 401 revoked_api_key" in mine and "audit key revoke app by root" in mine, mine
        assert "audit - GET models 401 invalid_api_key" in audit() and "second" not in mine
        assert app not in audit() and second not in audit()
    finally:
        box.write("/etc/pdctl/pdctl.toml", cfg)
        box.run([pdctl, "apply"], timeout=300)
        box.run(["rm", "-f", "/etc/pdctl/keys.toml", "/etc/pdctl/.keys.toml.lock"])
        _restart_proxy(box)
    assert _status(box, "/v1/models")[0] == 200, "the door must be open again without keys_file"


def test_api_key_from_the_settings_file(installed):
    """``[proxy] api_key_file`` in pdctl.toml + ``pdctl apply``: 401 without the key, 200 with it, /health open."""
    box = installed
    box.write("/etc/pdctl/api.key", KEY + "\n", mode=0o640)
    box.run(["chgrp", "pdctl", "/etc/pdctl/api.key"], check=True)
    cfg = box.read("/etc/pdctl/pdctl.toml")
    new = re.sub(r'(?m)^api_key_file\s*=.*$', 'api_key_file = "/etc/pdctl/api.key"', cfg)
    if new == cfg:
        new = cfg.replace("[proxy]\n", '[proxy]\napi_key_file = "/etc/pdctl/api.key"\n', 1)
    box.write("/etc/pdctl/pdctl.toml", new)
    try:
        r = box.run(["/usr/local/bin/pdctl", "apply"], timeout=300)
        assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-1500:]
        time.sleep(1)
        assert wait_until(lambda: curl(box, f"http://127.0.0.1:{PROXY_PORT}/health")[0] == 200, 30)
        assert _guarded(box) == (401, 200, 200)
    finally:
        box.write("/etc/pdctl/pdctl.toml", cfg)
        box.run(["/usr/local/bin/pdctl", "apply"], timeout=300)
        _restart_proxy(box)


TLS_DIR = "/etc/pdctl/tls"


def _server_pem(box, cafile: str) -> str:
    """The certificate a new TLS connection to the public port is shown (PEM), read inside the container."""
    code = ("import socket, ssl; c = ssl.create_default_context(cafile=%r); "
            "s = c.wrap_socket(socket.create_connection(('127.0.0.1', %d), 10), server_hostname='localhost'); "
            "print(ssl.DER_cert_to_PEM_cert(s.getpeercert(True)))" % (cafile, PROXY_PORT))
    r = box.run([VENV_PY, "-c", code], timeout=30)
    assert r.returncode == 0, r.stderr[-1500:]
    return r.stdout.strip()


def test_tls_on_by_apply_then_certificates_rotated_by_reload_under_load(installed, tmp_path):
    """``[proxy] tls_cert_file``/``tls_key_file`` + ``pdctl apply`` (a restart of the proxy: its listener is made
    anew for TLS): the public port speaks TLS (curl with the CA:
    200; without it: refused; plain HTTP: no answer), doctor's front-door row names the certificate's end; then
    a renewed certificate put in place and ``systemctl reload pd-proxy`` while a TLS load runs: new connections get
    the new certificate, and the load sees 0 refused, 0 cut, every answer whole."""
    from tests.tlscerts import CA
    from .common import LOAD_RPS, Load
    box = installed
    pdctl = "/usr/local/bin/pdctl"
    ca = CA(tmp_path / "pki")
    first, second = ca.issue("first"), ca.issue("second")
    cafile, cert, key = f"{TLS_DIR}/ca.pem", f"{TLS_DIR}/server.pem", f"{TLS_DIR}/server.key"

    def put(issued) -> None:
        box.write(cert, issued.cert.read_text(), mode=0o644)
        box.write(key, issued.key.read_text(), mode=0o640)
        box.run(["chgrp", "pdctl", key], check=True)

    box.write(cafile, ca.pem.read_text(), mode=0o644)
    put(first)
    cfg = box.read("/etc/pdctl/pdctl.toml")
    new = re.sub(r'(?m)^tls_cert_file\s*=.*$', f'tls_cert_file = "{cert}"', cfg)
    new = re.sub(r'(?m)^tls_key_file\s*=.*$', f'tls_key_file = "{key}"', new)
    assert new.count(TLS_DIR) == 2, "pdctl.toml has no tls_cert_file/tls_key_file lines (config template)"
    box.write("/etc/pdctl/pdctl.toml", new)
    https = f"https://127.0.0.1:{PROXY_PORT}"
    try:
        r = box.run([pdctl, "apply"], timeout=300)
        assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-1500:]
        assert wait_until(lambda: curl(box, https + "/v1/models", "--cacert", cafile)[0] == 200, 30), \
            curl(box, https + "/v1/models", "--cacert", cafile)
        assert curl(box, https + "/v1/models")[0] == 0                        # no CA: the handshake is refused
        assert curl(box, f"http://127.0.0.1:{PROXY_PORT}/health")[0] != 200    # plain HTTP gets no answer
        assert _server_pem(box, cafile) == first.cert.read_text().strip()
        d = box.run([pdctl, "doctor", "--json"], timeout=120)
        rows = {c["name"]: c for c in json.loads(d.stdout)["checks"]}
        assert rows["front door"]["status"] == "ok" and "certificate valid until" in rows["front door"]["detail"], \
            rows["front door"]
        p = plan(box)
        load = Load(box, p.get("served_model_name") or p["model"], LOAD_RPS, 12, max_tokens=32, check_text=True,
                    base=https, cafile=cafile)
        time.sleep(4)
        put(second)
        box.systemctl("reload", "pd-proxy.service", check=True, timeout=60)
        assert wait_until(lambda: _server_pem(box, cafile) == second.cert.read_text().strip(), 60), \
            "the renewed certificate is not served after the reload"
        res = load.result()
        assert "crashed" not in res, res
        assert res["refused"] == 0 and res["cut"] == 0 and res["other"] == 0 and res["ok"] == res["sent"], res
        journal = box.run(["journalctl", "-u", "pd-proxy.service", "--no-pager", "-n", "100"]).stdout
        assert "TLS on -> on" in journal, journal[-1500:]
    finally:
        box.write("/etc/pdctl/pdctl.toml", cfg)
        box.run([pdctl, "apply"], timeout=300)
        box.run(["rm", "-rf", TLS_DIR])
        _restart_proxy(box)
    assert _guarded(box)[0] == 200, "plain HTTP again without the TLS keys"
