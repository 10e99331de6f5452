"""Shared helpers of the fault/security suite: one installed appliance (twin, --simulate) per package run.

The install itself reuses the lead's wheelhouse builder (tests/install): the container has no network.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from appliance.proxy.config import ProxyConfig

from tests.install.common import WHEELHOUSE, build_wheelhouse, install  # noqa: F401 (re-exported)
from tests.waits import wait_until  # noqa: F401 (re-exported: the fault tests poll with it)

REPO = Path(__file__).resolve().parents[2]
VENV_PY = sys.executable
LOADCLIENT = str(REPO / "tests" / "faults" / "loadclient.py")
PDCTL = "/usr/local/bin/pdctl"
GPUS = "fake:4xH200"
STALL_FLOOR_S = 12.0   # the box's [proxy] stall_floor_s (product default 5 s): a worker silent this long is hung.
#                        Above what a busy CI machine costs the twin engines (a run with a busy core saw them
#                        silent 8.6 s while the proxy restarted under load, and at 5 s their streams were cut as
#                        hung), below the hung-decoder row's hang (test_faults_systemd.HANG_S)
PROXY_WATCHDOG_S = 30.0  # the box's [proxy] watchdog_s (product default 10 s: pings every 5 s while its own /health
#                          answers within 5 s). ci11, a run starved past one busy core, lost 34 streams at once in
#                          the decoder-500 row (p50 15 s, every open request cut before its first byte, the way a
#                          proxy restart cuts them): most likely the watchdog, whose question is a wedged proxy, not
#                          a slow machine. No row of this suite tests the proxy's watchdog (test_proxy_lifecycle
#                          tests the KV server's; tests/proxy/test_lifecycle the proxy's, in-process)
TPOT_SLO_MS = 2000.0     # the box's [workload] tpot_slo_ms (default 80): admission must not read a starved
#                          machine's slow twin decoding as overload (conftest.py)
COMFORTABLE_RPS = 4.0     # what the twin stack (1P3D) serves on a 2-core CI box with p50 flat (measured: 12 rps ok)
LOAD_RPS = 2 * COMFORTABLE_RPS


def plan(box) -> dict:
    return json.loads(box.read("/etc/pdctl/plan.json"))


def worker(box, instance: str) -> dict:
    return next(w for w in plan(box)["workers"] if w["instance"] == instance)


def unit_of(instance: str) -> str:
    return f"pd-worker@{instance}.service"


def main_pid(box, unit: str) -> int:
    return int(box.show(unit, "MainPID")["MainPID"])


def engine_pid(box, unit: str) -> int:
    """The engine under the launcher (the unit's MainPID's child); the MainPID when it has no child."""
    mp = main_pid(box, unit)
    r = box.run(["ps", "-o", "pid=", "--ppid", str(mp)])
    kids = [int(x) for x in r.stdout.split()]
    return kids[0] if kids else mp


def restarts(box, unit: str) -> int:
    return int(box.show(unit, "NRestarts")["NRestarts"])


def curl(box, url: str, *extra: str, timeout: float = 10, max_s: float = 3) -> tuple:
    """(http status, body) from inside the container; status 0 when nothing answered within ``max_s``."""
    r = box.run(["curl", "-s", "-m", f"{max_s:g}", "-o", "/dev/stdout", "-w", "\n%{http_code}", *extra, url],
                timeout=timeout)
    body, _, code = r.stdout.rpartition("\n")
    return int(code or 0), body


def proxy_status(box) -> dict | None:
    code, body = curl(box, "http://127.0.0.1:9001/pdctl/status")
    if code != 200:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def settled(box, timeout: float = 120.0) -> bool:
    """Every backend admitted and KV-warmed, nothing in flight, at two reads a canary interval apart.

    Why: after a restart the proxy warms each worker's KV (proxy/warmup.py: a producer stores a ~1,450-token
    prompt nobody asked for, a lookup that misses by design) after the canary that follows its re-admission;
    inside a window that counts the KV server's hit rate it reads as a recovery that did not happen (ci29: 0.42
    where the ceiling is 0.50); and while the proxy still sees the KV server down it skips the P leg."""
    def now() -> bool:
        st = proxy_status(box) or {}
        warm = st.get("kv_warm") or {}
        return (bool(warm) and all(warm.values()) and not st.get("inflight")
                and (st.get("kv_server") or {}).get("up", False)
                and all(b.get("state") == "closed" for b in st.get("backends", [])))

    for _ in range(2):
        if not wait_until(now, timeout, 0.5):
            return False
        time.sleep(ProxyConfig.canary_interval_s + 1.0)
    return bool(wait_until(now, timeout, 0.5))


def backend(box, instance: str) -> dict | None:
    """The proxy's view of one backend (breaker state, opened_by, last_error, ...)."""
    st = proxy_status(box)
    if not st:
        return None
    port = str(worker(box, instance)["port"])
    for b in st.get("backends", []):
        if b.get("name") == instance or str(b.get("url", "")).endswith(":" + port):
            return b
    return None


def backend_state(box, instance: str) -> str | None:
    b = backend(box, instance)
    return b.get("state") if b else None


def set_fault(box, instance: str, mode: str, arg=None) -> None:
    """Switch a twin engine's fault. Setting a mode is idempotent, so a call nothing answered is made again: a
    starved CI box once let the engine's admin route miss curl's 3 s (ci14: the decoder-500 row's clearing call)."""
    port = worker(box, instance)["port"]
    body = json.dumps({"mode": mode, **({"arg": arg} if arg is not None else {})})
    for _ in range(3):
        code, text = curl(box, f"http://127.0.0.1:{port}/twin/fault", "-X", "POST", "-H",
                          "Content-Type: application/json", "-d", body, timeout=40, max_s=30)
        if code:
            break
    assert code == 200, f"fault {mode} on {instance}: HTTP {code} {text[:300]}"


def pdctl_status(box) -> dict | None:
    r = box.run([PDCTL, "status", "--json"], timeout=30)
    try:
        return json.loads(r.stdout)
    except ValueError:
        return None


def kv_counters(box) -> tuple:
    """(lookup requested tokens, lookup hit tokens) from the KV server's /metrics; (0, 0) when down."""
    code, text = curl(box, "http://127.0.0.1:6080/metrics")
    req = hit = 0.0
    if code == 200:
        for ln in text.splitlines():
            if ln.startswith("lmcache_mp_lookup_requested_tokens_total"):
                req = float(ln.split()[-1])
            elif ln.startswith("lmcache_mp_lookup_hit_tokens_total"):
                hit = float(ln.split()[-1])
    return req, hit


class Load:
    """The load client running inside the container, in a thread of ours; ``result()`` joins it."""

    def __init__(self, box, model: str, rps: float, seconds: float, key: str = "", prompts: str = "unique",
                 max_tokens: int = 16, check_text: bool = False, base: str = "http://127.0.0.1:9000",
                 cafile: str = ""):
        """``check_text``: every answer must be the twin's exact answer (MAX_TOKENS filler words from the
        first): a stream continued on another worker with repeated or lost text counts as garbled. ``base``
        https: over TLS, trusting ``cafile`` (a path inside the container)."""
        from appliance.twin.tokens import FILLER_WORDS
        self.out: dict = {}
        args = [VENV_PY, LOADCLIENT, base, model, str(rps), str(seconds),
                "http://127.0.0.1:9001/pdctl/status", key, prompts, str(max_tokens),
                ",".join(FILLER_WORDS) if check_text else ""]
        env = {"LOADCLIENT_CAFILE": cafile} if cafile else None

        def go():
            r = box.run(args, timeout=seconds + 90, env=env)
            try:
                self.out = json.loads(r.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                self.out = {"crashed": r.stderr[-2000:]}

        self.t = threading.Thread(target=go, daemon=True)
        self.t.start()

    def result(self) -> dict:
        self.t.join()
        return self.out
