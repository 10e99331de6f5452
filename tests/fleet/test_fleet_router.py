"""The real vllm-router (via `pdctl fleet run`) in front of a live twin box and a dead one, on loopback,
and `pdctl fleet status` reading both boxes and the router over HTTP."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from appliance import constants as C
from appliance.cli import main
from appliance.fleet.plan import Node, make_fleet_plan
from appliance.stack.twin_stack import Stack, twin_plan

from .routerproc import free_port, per_worker, metrics, start_router, stop, wait_http, write_json

ROUTER = Path(sys.executable).parent / "vllm-router"
pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason=f"{C.ROUTER_PACKAGE} not installed in this venv")


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    wd = tmp_path_factory.mktemp("box")
    st = Stack(plan=twin_plan("fake:3xA100-80GB", "deepseek-v2-lite", wd, time_scale=0.5), workdir=wd)
    try:
        st.start(ready_timeout=60)
        yield st
    finally:
        st.stop()


def test_router_routes_around_a_dead_box_and_status_sees_both(box, tmp_path, capsys):
    live = Node("127.0.0.1", box.plan.proxy.port, name="live", status_port=box.plan.proxy.internal_port)
    dead = Node("127.0.0.1", free_port(), name="dead")
    fleet = make_fleet_plan([live, dead], listen=f"127.0.0.1:{free_port()}", metrics=f"127.0.0.1:{free_port()}",
                            startup_timeout_s=5)
    ff = write_json(tmp_path / "fleet.json", fleet.to_json())
    log = tmp_path / "router.log"
    proc = start_router(ff, log)
    try:
        wait_http(fleet.router.url + "/list_workers", 30, proc, log)
        model = box.plan.served_model_name
        codes = []
        with httpx.Client(timeout=30) as c:
            for i in range(8):
                body = {"model": model, "prompt": f"fleet request {i} " * 20, "max_tokens": 8, "stream": i % 2 == 1}
                r = c.post(fleet.router.url + "/v1/completions", json=body)
                codes.append(r.status_code)
                if body["stream"]:
                    assert r.text.rstrip().endswith("data: [DONE]")
        assert codes == [200] * 8, log.read_text()[-2000:]
        # the router's own health checks take the dead box out (2 failures x 2 s)
        for _ in range(300):                   # ~4 s; up to 60 s
            m = metrics(fleet.router.metrics_url)
            if per_worker(m, C.ROUTER_WORKER_HEALTH).get(dead.url) == 0:
                break
            time.sleep(0.2)
        assert per_worker(m, C.ROUTER_WORKER_HEALTH) == {live.url: 1, dead.url: 0}

        assert main(["fleet", "status", "--fleet", str(ff), "--json"]) == 1     # one box is down
        view = json.loads(capsys.readouterr().out)
        assert view["router"] == "ok"
        b_live, b_dead = view["boxes"]
        assert (b_live["health"], b_live["ready"], b_live["detail"]) == ("ok", "ready", "")
        assert b_live["router_health"] == "healthy" and b_live["router_breaker"] == "closed"
        assert b_live["requests_ok"] >= 8 and b_live["router_requests"] >= 8
        assert b_dead["health"].startswith("down") and b_dead["router_health"] == "unhealthy"

        # cache_aware reads each text prompt's tokens from every healthy box's render route (the proxy answers it
        # from the engines' /tokenize). While the dead box still counted as healthy (the 8 requests above) the
        # router lacked its tokens and routed by load; now that it is out, every text request is token-matched.
        from appliance.fleet.status import render_support
        assert render_support(live) == "yes" and render_support(dead).startswith("unknown")

        def decisions():
            return {dict(k[1]).get("outcome"): v for k, v in metrics(fleet.router.metrics_url).items()
                    if k[0].startswith(C.ROUTER_PREFIX_DECISIONS.removesuffix("_total"))}
        before = decisions()
        with httpx.Client(timeout=30) as c:
            for i in range(4):
                body = {"model": model, "prompt": "shared fleet system prompt " * 30 + f"question {i}",
                        "max_tokens": 4}
                assert c.post(fleet.router.url + "/v1/completions", json=body).status_code == 200
            chat = {"model": model, "messages": [{"role": "user", "content": "fleet chat " * 30}], "max_tokens": 4}
            assert c.post(fleet.router.url + "/v1/chat/completions", json=chat).status_code == 200
            st = c.get(f"http://127.0.0.1:{box.plan.proxy.internal_port}/pdctl/status").json()
        after = decisions()
        assert sum(after.values()) - sum(before.values()) == 5, (before, after)
        assert after.get("missing_tokens", 0) == before.get("missing_tokens", 0), (before, after)
        assert after.get("prefix_hit", 0) - before.get("prefix_hit", 0) >= 3, (before, after)
        assert st["requests"].get("render:ok", 0) >= 5, st["requests"]
        assert main(["fleet", "status", "--fleet", str(ff)]) == 1
        capsys.readouterr()

        # without the status port the box's public port answers 404 for /pdctl/status: shown as "off", not a crash
        public_only = make_fleet_plan([Node("127.0.0.1", box.plan.proxy.port, name="live")],
                                      listen=fleet.router.host + f":{fleet.router.port}",
                                      metrics=f"{fleet.router.metrics_host}:{fleet.router.metrics_port}")
        f2 = write_json(tmp_path / "fleet2.json", public_only.to_json())
        assert main(["fleet", "status", "--fleet", str(f2)]) == 0
        text = capsys.readouterr().out
        assert "is off on this box" in text and "ready" in text
    finally:
        stop(proc)
    assert proc.poll() is not None


def test_router_passes_the_box_api_key_through(box, tmp_path, capsys):
    """Boxes enforce their API key; the router forwards the client's Authorization header unchanged."""
    key = tmp_path / "key"
    key.write_text("fleet-secret\n")
    port = free_port()
    legs = [a for w in box.plan.workers if w.role in ("prefill", "decode", "both") for a in (f"--{w.role}", w.url())]
    log = tmp_path / "keyed-proxy.log"
    with open(log, "wb") as fh:
        keyed = subprocess.Popen([sys.executable, "-m", "appliance", "proxy", "--listen", f"127.0.0.1:{port}",
                                  "--internal", "127.0.0.1:0", *legs,
                                  "--api-key-file", str(key)], stdout=fh, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    router = None
    try:
        wait_http(f"http://127.0.0.1:{port}/ready", 60, keyed, log)
        fleet = make_fleet_plan([Node("127.0.0.1", port, name="keyed")], listen=f"127.0.0.1:{free_port()}",
                                metrics=f"127.0.0.1:{free_port()}")
        ff = write_json(tmp_path / "fleet.json", fleet.to_json())
        router = start_router(ff, tmp_path / "router.log")
        wait_http(fleet.router.url + "/list_workers", 30, router, tmp_path / "router.log")
        body = {"model": box.plan.served_model_name, "prompt": "keyed hello", "max_tokens": 4}
        with httpx.Client(timeout=30) as c:
            denied = c.post(fleet.router.url + "/v1/completions", json=body)
            wrong = c.post(fleet.router.url + "/v1/completions", json=body,
                           headers={"Authorization": "Bearer nope"})
            ok = c.post(fleet.router.url + "/v1/completions", json=body,
                        headers={"Authorization": "Bearer fleet-secret"})
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        assert wrong.status_code == 401
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
        m = metrics(fleet.router.metrics_url)
        assert per_worker(m, C.ROUTER_CB_STATE) == {fleet.nodes[0].url: 0}   # 401s do not open the box's breaker
        assert main(["fleet", "status", "--fleet", str(ff), "--api-key-file", str(key)]) == 0
        assert "keyed" in capsys.readouterr().out
    finally:
        if router is not None:
            stop(router)
        stop(keyed)
