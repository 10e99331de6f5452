"""``pdctl fleet status``: the front node's view of every box, reached over HTTP.

Per box: the public ``/health`` and ``/ready`` (no key needed) and, when the box enables it, the read-only
``/pdctl/status`` with the API key. Per router: its own Prometheus metrics (health and breaker per box,
requests routed). Every field is a value or an NA with the reason, never an exception.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from .. import constants as C
from ..wire.fetch import Reply, fetch_sync
from .plan import FleetPlan, Node

CB_STATES = {0: "closed", 1: "open", 2: "half-open"}


@dataclass(frozen=True)
class BoxView:
    name: str
    url: str
    health: str                     # "ok" | "down: <why>" | "HTTP <n>"
    ready: str                      # "ready" | "not ready: <why>" | "NA: <why>"
    detail: str = ""                # "" when /pdctl/status answered; else why it is missing
    prefill_hit_rate: float | None = None   # lifetime external prefix hit rate of the box's prefillers
    requests_ok: int | None = None
    requests_failed: int | None = None
    inflight: int | None = None
    open_breakers: tuple = ()
    router_health: str = "NA"       # the router's view: "healthy" | "unhealthy" | "NA"
    router_breaker: str = "NA"
    router_requests: float | None = None
    router_running: float | None = None


@dataclass(frozen=True)
class FleetView:
    router_url: str
    router: str                      # "ok" | "down: <why>"
    boxes: tuple
    router_retries: float | None = None
    prefix_decisions: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return json.loads(json.dumps(asdict(self)))


def _err(r: Reply) -> str:
    """Why a request got no answer, in the words of the status table."""
    if r.timed_out:
        return "timed out"
    if r.unreachable and "CERTIFICATE_VERIFY_FAILED" in r.error:
        return ("TLS: the box's certificate is not trusted (CERTIFICATE_VERIFY_FAILED): pass --ca-file with the CA "
                "that signed it")
    if r.unreachable:
        return "connection refused or unreachable"
    return r.error


def box_view(node: Node, api_key: str | None, timeout: float = 2.0, tls=None) -> BoxView:
    """``tls``: the client context for https boxes (default: the system's CAs)."""
    r = fetch_sync(node.url + "/health", timeout_s=timeout, tls=tls)
    if r.error:
        return BoxView(node.label, node.url, f"down: {_err(r)}", "NA: box down", "box down")
    health = "ok" if r.status == 200 else f"HTTP {r.status}"
    r = fetch_sync(node.url + "/ready", timeout_s=timeout, tls=tls)
    if r.error:
        ready = f"NA: {_err(r)}"
    elif r.status == 200:
        ready = "ready"
    else:
        try:
            why = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            why = f"HTTP {r.status}"
        ready = f"not ready: {why}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = fetch_sync(node.status_url, headers=headers, timeout_s=timeout, tls=tls)
    if r.error:
        return BoxView(node.label, node.url, health, ready, f"status endpoint: {_err(r)}")
    if r.status == 404:
        return BoxView(node.label, node.url, health, ready,
                       f"{C.BOX_STATUS_PATH} is off on this box (enable the proxy's public status endpoint)")
    if r.status in (401, 403):
        return BoxView(node.label, node.url, health, ready,
                       f"{C.BOX_STATUS_PATH} refused the API key (HTTP {r.status}); pass --api-key-file")
    if r.status != 200:
        return BoxView(node.label, node.url, health, ready, f"{C.BOX_STATUS_PATH} answered HTTP {r.status}")
    try:
        return summarize(node, health, ready, r.json())
    except (ValueError, TypeError, AttributeError) as exc:
        return BoxView(node.label, node.url, health, ready, f"{C.BOX_STATUS_PATH}: unexpected body ({exc})")


def summarize(node: Node, health: str, ready: str, st: dict) -> BoxView:
    """The few numbers a fleet row needs, from one box's /pdctl/status JSON."""
    backends = st.get("backends") or []
    pre = [b for b in backends if b.get("role") == "prefill"] or backends
    q = sum(float(b.get("external_prefix_queries") or 0) for b in pre)
    h = sum(float(b.get("external_prefix_hits") or 0) for b in pre)
    reqs = st.get("requests") or {}
    ok = sum(int(v) for k, v in reqs.items() if k.endswith(":ok"))
    failed = sum(int(v) for k, v in reqs.items() if not k.endswith(":ok") and not k.endswith(":unauthorized"))
    return BoxView(node.label, node.url, health, ready, "", prefill_hit_rate=(h / q) if q else None,
                   requests_ok=ok, requests_failed=failed, inflight=int(st.get("inflight") or 0),
                   open_breakers=tuple(b.get("name", "?") for b in backends if b.get("state") != "closed"))


def router_metrics(url: str, timeout: float = 2.0) -> tuple[dict, str]:
    """``{(name, frozenset(labels)): value}`` from the router's Prometheus text, and an error ('' if none)."""
    from prometheus_client.parser import text_string_to_metric_families
    r = fetch_sync(url, timeout_s=timeout)
    if r.error:
        return {}, f"metrics {url}: {_err(r)}"
    if r.status != 200:
        return {}, f"metrics {url}: HTTP {r.status}"
    out: dict = {}
    try:
        for fam in text_string_to_metric_families(r.text):
            for s in fam.samples:
                out[(s.name, frozenset(s.labels.items()))] = s.value
    except ValueError as exc:
        return {}, f"metrics {url}: unparsable ({exc})"
    return out, ""


def _get(m: dict, name: str, **labels) -> float | None:
    base = name[:-6] if name.endswith("_total") else name
    for n in (name, base):
        v = m.get((n, frozenset(labels.items())))
        if v is not None:
            return v
    return None


def collect(fleet: FleetPlan, api_key: str | None = None, timeout: float = 2.0, tls=None) -> FleetView:
    with ThreadPoolExecutor(max_workers=min(16, len(fleet.nodes) + 1)) as ex:
        futs = [ex.submit(box_view, n, api_key, timeout, tls) for n in fleet.nodes]
        metrics, merr = router_metrics(fleet.router.metrics_url, timeout)
        boxes = [f.result() for f in futs]
    router = "ok"
    r = fetch_sync(fleet.router.url + "/list_workers", timeout_s=timeout)
    if r.error:
        router = f"down: {_err(r)}"
    elif r.status != 200:
        router = f"down: /list_workers HTTP {r.status}"
    out = []
    for b, n in zip(boxes, fleet.nodes):
        w = n.url
        hv = _get(metrics, C.ROUTER_WORKER_HEALTH, worker=w)
        cb = _get(metrics, C.ROUTER_CB_STATE, worker=w)
        # with metrics at hand, an absent per-box sample means "never used": breaker closed, zero requests
        seen = bool(metrics)
        req = _get(metrics, C.ROUTER_PROCESSED, worker=w)
        run = _get(metrics, C.ROUTER_RUNNING, worker=w)
        out.append(BoxView(**{**asdict(b),
                              "router_health": "NA" if hv is None else ("healthy" if hv >= 1 else "unhealthy"),
                              "router_breaker": CB_STATES.get(int(cb), str(cb)) if cb is not None else
                              ("closed" if seen else "NA"),
                              "router_requests": req if req is not None or not seen else 0.0,
                              "router_running": run if run is not None or not seen else 0.0}))
    decisions = {dict(k[1]).get("outcome", "?"): v for k, v in metrics.items()
                 if k[0] in (C.ROUTER_PREFIX_DECISIONS, C.ROUTER_PREFIX_DECISIONS[:-6])}
    retries = sum(v for k, v in metrics.items() if k[0] in (C.ROUTER_RETRIES, C.ROUTER_RETRIES[:-6])) \
        if metrics else None
    if merr and router == "ok":
        router = f"ok (metrics NA: {merr})"
    return FleetView(fleet.router.url, router, tuple(out), retries, decisions)


def _n(v: Any, fmt: str = "{:.0f}") -> str:
    return "NA" if v is None else fmt.format(v)


def render_text(view: FleetView) -> str:
    lines = [f"router {view.router_url}  {view.router}  retries {_n(view.router_retries)}  prefix decisions "
             + (", ".join(f"{k} {v:.0f}" for k, v in sorted(view.prefix_decisions.items())) or "NA")]
    lines.append(f"{'box':<22}{'health':<10}{'ready':<10}{'router':<11}{'breaker':<10}{'routed':>7}{'run':>5}"
                 f"{'ok':>7}{'fail':>6}{'P hit':>7}")
    notes = []
    for b in view.boxes:
        ready = "ready" if b.ready == "ready" else ("no" if b.ready.startswith("not") else "NA")
        lines.append(f"{b.name[:21]:<22}{b.health.split(':')[0][:9]:<10}{ready:<10}{b.router_health:<11}"
                     f"{b.router_breaker:<10}{_n(b.router_requests):>7}{_n(b.router_running):>5}"
                     f"{_n(b.requests_ok):>7}{_n(b.requests_failed):>6}"
                     f"{_n(None if b.prefill_hit_rate is None else 100 * b.prefill_hit_rate, '{:.0f}%'):>7}")
        whys = [b.health] if b.health.startswith("down") else \
            [b.ready if b.ready != "ready" else "", b.detail,
             ("open breakers: " + ", ".join(b.open_breakers)) if b.open_breakers else ""]
        for why in whys:
            if why:
                notes.append(f"  {b.name}: {why}")
    missing = view.prefix_decisions.get("missing_tokens", 0)
    if missing:
        notes.append(f"  router: {missing:.0f} request(s) routed by load only: cache_aware asks each box's "
                     "/v1/completions/render or /v1/chat/completions/render for the prompt's tokens and a box did "
                     "not answer (an older pdctl, no healthy engine, or a 4xx); `pdctl fleet status` per box, or "
                     "send token-id prompts, or use --policy consistent_hash with X-Session-Id")
    if notes:
        lines += ["", "why:"] + notes
    return "\n".join(lines) + "\n"


def render_support(node: Node, api_key: str | None = None, timeout: float = 2.0) -> str:
    """Whether the box answers POST /v1/completions/render, which vllm-router's cache_aware asks for every text
    prompt (pdctl >= this version answers it from the engines' /tokenize): yes | no | unknown (why)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = fetch_sync(node.url + "/v1/completions/render", "POST", json.dumps({"prompt": "pdctl probe"}).encode(),
                   headers, timeout_s=timeout)
    if r.error:
        return f"unknown ({_err(r)})"
    if r.status in (404, 405, 501):
        return "no"
    return "yes" if r.status == 200 else f"unknown (HTTP {r.status})"
