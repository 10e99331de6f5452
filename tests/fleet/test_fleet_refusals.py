"""The real vllm-router 0.1.17, started by `pdctl fleet run` with the fleet plan's flags, in front of two stand-in
boxes that refuse the way a pdctl box's admission does (Retry-After: 2, OpenAI's error body, code
server_overloaded): a 429 is retried on the next box without touching its breaker, a 503 opens the breaker and the
router then refuses by itself without Retry-After. What benchmarks/fleet_overload.py measures in full, pinned here
because docs/fleet.md and the plan's reasons tell operators to refuse with 429 behind the router."""
from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from appliance import constants as C
from appliance.fleet.plan import Node, make_fleet_plan

from .routerproc import free_port, metrics, per_worker, start_router, stop, wait_http, write_json

ROUTER = Path(sys.executable).parent / "vllm-router"
pytestmark = pytest.mark.skipif(not ROUTER.exists(), reason=f"{C.ROUTER_PACKAGE} not installed in this venv")


class StandIn(ThreadingHTTPServer):
    """A box: /health and /ready 200, the render routes, /v1/completions served or refused with ``refuse``."""
    daemon_threads = True

    def __init__(self, name: str):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.name, self.refuse, self.attempts = name, None, []
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _send(self, status: int, body: dict | list, headers: dict | None = None) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(raw)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        self._send(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]}
                   if self.path.startswith("/v1/models") else {})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        box: StandIn = self.server
        if self.path.endswith("/render"):
            item = {"request_id": "r", "token_ids": [1000 + len(w) for w in str(req.get("prompt", "")).split()]}
            return self._send(200, item if "chat" in self.path else [item])
        box.attempts.append(req.get("user"))
        if box.refuse:
            return self._send(box.refuse, {"error": {"message": "the server is overloaded; retry after 2 s",
                                                     "type": "service_unavailable", "param": None,
                                                     "code": "server_overloaded"}}, {"Retry-After": "2"})
        self._send(200, {"id": "cmpl-1", "object": "text_completion", "model": "tiny",
                         "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]})


@pytest.fixture
def fleet(tmp_path):
    """Two stand-in boxes and the router over them (round_robin: the policy that moves a retried 429 on)."""
    boxes = [StandIn("a"), StandIn("b")]
    plan = make_fleet_plan([Node("127.0.0.1", b.server_address[1], name=b.name) for b in boxes],
                           policy="round_robin", listen=f"127.0.0.1:{free_port()}",
                           metrics=f"127.0.0.1:{free_port()}", startup_timeout_s=10)
    log = tmp_path / "router.log"
    proc = start_router(write_json(tmp_path / "fleet.json", plan.to_json()), log)
    try:
        wait_http(plan.router.url + "/list_workers", 30, proc, log)
        yield plan, boxes, log
    finally:
        stop(proc)
        for b in boxes:
            b.shutdown()
            b.server_close()


def _ask(c: httpx.Client, plan, i: int) -> httpx.Response:
    return c.post(plan.router.url + "/v1/completions",
                  json={"model": "tiny", "prompt": f"question {i}", "max_tokens": 2, "user": f"r{i}"})


def test_a_429_is_retried_on_the_other_box_and_never_opens_a_breaker(fleet):
    plan, (a, b), log = fleet
    a.refuse = 429
    with httpx.Client(timeout=30) as c:
        got = [_ask(c, plan, i).status_code for i in range(6)]
        assert got == [200] * 6, log.read_text()[-2000:]
        assert len(b.attempts) == 6 and set(a.attempts) <= set(b.attempts)     # every refusal went on to b
        b.refuse = 429                    # the whole fleet full: bounded attempts, the box's answer reaches the client
        a.attempts.clear()
        b.attempts.clear()
        r = _ask(c, plan, 99)
    assert r.status_code == 429 and r.headers.get("retry-after") == "2"
    assert r.json()["error"]["code"] == "server_overloaded"
    assert len(a.attempts) + len(b.attempts) == plan.router.retries        # --retry-max-retries counts every attempt
    cb = per_worker(metrics(plan.router.metrics_url), C.ROUTER_CB_STATE)
    assert cb.get(a.url, 0) == 0 and cb.get(b.url, 0) == 0                   # 429 counts as a success for the breaker


def test_503_refusals_open_the_breakers_and_the_router_refuses_by_itself(fleet):
    """Why the boxes refuse with 429 behind the router: two 503s open a box's breaker (cb_failures), and with both
    open the router answers its own 503, no Retry-After, no OpenAI body, for the breaker's open time."""
    plan, (a, b), log = fleet
    a.refuse = b.refuse = 503
    with httpx.Client(timeout=30) as c:
        answers = [_ask(c, plan, i) for i in range(3)]
    assert [r.status_code for r in answers] == [503] * 3
    assert answers[0].headers.get("retry-after") == "2"                      # the last box's own refusal
    last = answers[-1]
    assert last.headers.get("retry-after") is None and "No available workers" in last.text, last.text
    assert len(a.attempts) == len(b.attempts) == plan.router.cb_failures     # then no box saw another attempt
    cb = per_worker(metrics(plan.router.metrics_url), C.ROUTER_CB_STATE)
    assert cb.get(a.url) == 1 and cb.get(b.url) == 1                         # 1 = open
