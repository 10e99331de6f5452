"""One twin box inside a network namespace (run under `ip netns exec NS`), for tests/fleet/test_netns.py.

``run WORKDIR``: KV server + twin engines on the namespace's loopback, the pdctl proxy on 0.0.0.0 (the
namespace's veth), then ``WORKDIR/box.json``; SIGTERM stops everything it started.
``probe WORKDIR``: the box's internal /pdctl/status and each engine's prompt-token counters, as JSON.
"""
from __future__ import annotations

import json
import signal
import sys
import threading
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from appliance.settings.config import atomic_write  # noqa: E402
from appliance.stack.twin_stack import Stack, twin_plan  # noqa: E402


def run(wd: Path, gpus: str, time_scale: float) -> int:
    wd.mkdir(parents=True, exist_ok=True)
    st = Stack(plan=twin_plan(gpus, "deepseek-v2-lite", wd, time_scale=time_scale), workdir=wd)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    try:
        (wd / "run" / "twin").mkdir(parents=True, exist_ok=True)
        (wd / "plan.json").write_text(json.dumps(st.plan.to_json(), indent=2))
        st.config_path.write_text("schema_version = 1\n")
        kv = st.plan.kv_server
        st._spawn("kvserver", list(kv.argv), kv.env)
        st.wait_http(f"{kv.http_url}/healthcheck", 60, "KV server")
        for w in st.plan.workers:
            st._spawn(w.instance, list(w.argv), w.env)
        for w in st.plan.workers:
            st.wait_http(f"{w.url()}/health", 60, w.instance)
        p = st.plan.proxy
        # the box's public face: every interface of its namespace, like pd-proxy on a real box
        st._spawn("proxy", [sys.executable, "-m", "appliance", "proxy", "--config", str(st.config_path),
                            "--listen", f"0.0.0.0:{p.port}", "--internal", f"127.0.0.1:{p.internal_port}"], {})
        st.wait_http(f"http://127.0.0.1:{p.port}/ready", 60, "proxy /ready")
        # atomic: the test polls for the file and reads it as soon as it exists (ci46 read it empty once)
        atomic_write(wd / "box.json", json.dumps({
            "proxy_port": p.port, "internal_port": p.internal_port,
            "pids": [pr.pid for pr in st.procs.values()],
            "workers": [{"instance": w.instance, "role": w.role, "url": w.url()} for w in st.plan.workers]}))
        done.wait()
    finally:
        st.stop()
    return 0


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=3) as r:
        return r.read().decode()


def probe(wd: Path) -> int:
    from prometheus_client.parser import text_string_to_metric_families
    box = json.loads((wd / "box.json").read_text())
    out = {"status": json.loads(_get(f"http://127.0.0.1:{box['internal_port']}/pdctl/status")), "workers": {}}
    for w in box["workers"]:
        c = {"role": w["role"], "prompt_tokens": 0.0, "by_source": {}}
        for fam in text_string_to_metric_families(_get(w["url"] + "/metrics")):
            for s in fam.samples:
                if s.name == "vllm:prompt_tokens_total":
                    c["prompt_tokens"] += s.value
                elif s.name == "vllm:prompt_tokens_by_source_total":
                    src = s.labels.get("source", "?")
                    c["by_source"][src] = c["by_source"].get(src, 0.0) + s.value
        out["workers"][w["instance"]] = c
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    mode, wd = sys.argv[1], Path(sys.argv[2])
    if mode == "run":
        sys.exit(run(wd, sys.argv[3] if len(sys.argv) > 3 else "fake:3xA100-80GB",
                     float(sys.argv[4]) if len(sys.argv) > 4 else 0.5))
    sys.exit(probe(wd))
