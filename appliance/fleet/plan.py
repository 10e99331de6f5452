"""FleetPlan: boxes (each a pdctl proxy) -> the vllm-router command that routes across them. Pure, no I/O.

Every router flag below exists in ``vllm-router 0.1.17 --help``; the values are chosen so that a stopped
box is taken out within a few seconds and a request that failed before its first byte is retried on
another box (connection errors and 5xx count towards the per-box circuit breaker).

A box's admission refusals (issue 28) are the router's to spread, and vllm-router 0.1.17 treats the two statuses
differently (benchmarks/fleet_overload.py, docs/fleet.md): it retries both 429 and 503 (up to ``retries``
attempts, its own 50-500 ms backoff; it ignores Retry-After and hands the last box's answer, Retry-After
included, to the client), but a 503 counts against the box's breaker and a 429 does not. With 503 two refusals
open the box's breaker and the router then answers "No available workers" itself (no Retry-After) until it
closes, even at 0.7x of the fleet's capacity; so boxes behind the router refuse with ``[admission] status =
429``. A 429 is retried on the box the policy picks again: cache_aware moves it to another box once the loads
differ by ``balance_abs`` requests and ``balance_rel`` times (the router's load: requests in flight per box).
"""
from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import asdict, dataclass

from .. import constants as C

# policies of vllm-router 0.1.17 that need nothing but the boxes' URLs (kv_aware needs engine KV events)
POLICIES = ("cache_aware", "consistent_hash", "power_of_two", "round_robin", "sticky_least_loaded", "random")
DEFAULT_POLICY = "cache_aware"
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}"
                       r"[A-Za-z0-9])?)*$")


class FleetError(ValueError):
    """Bad fleet input: the message says what, where and how to fix it."""


@dataclass(frozen=True)
class Node:
    host: str
    port: int = C.PROXY_PORT
    name: str = ""
    status_port: int = 0      # where the box's read-only status answers; 0 = its public port
    scheme: str = "http"      # "https" for a box with TLS on its public port ([proxy] tls_cert_file)

    @property
    def label(self) -> str:
        return self.name or self.hostport

    @property
    def hostport(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"{h}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.hostport}"

    @property
    def status_url(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{h}:{self.status_port or self.port}{C.BOX_STATUS_PATH}"


@dataclass(frozen=True)
class RouterPlan:
    version: str
    host: str
    port: int
    metrics_host: str
    metrics_port: int
    policy: str
    health_path: str = "/ready"           # a box is routable while its PD canary passes, not merely alive
    health_interval_s: int = 2
    health_timeout_s: int = 2
    health_failures: int = 2
    health_successes: int = 2
    cb_failures: int = 2                  # two failed attempts open the box's breaker: the retry goes elsewhere
    cb_open_s: int = 10
    retries: int = 3                      # attempts in all (vllm-router's --retry-max-retries counts the first)
    retry_backoff_ms: int = 50
    retry_max_backoff_ms: int = 500
    balance_abs: int = 64                 # cache_aware balances by load once in-flight requests differ by this
    balance_rel: float = 1.5              # ... and the busier box has this many times the other's
    startup_timeout_s: int = 60           # a box down at boot must not hold the router for vllm-router's 600 s
    request_timeout_s: int = 1800
    cache_threshold: float = 0.3
    argv: tuple = ()                      # vllm-router arguments (without the executable)

    @property
    def url(self) -> str:
        h = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{h}:{self.port}"

    @property
    def metrics_url(self) -> str:
        h = "127.0.0.1" if self.metrics_host in ("0.0.0.0", "::") else self.metrics_host
        return f"http://{h}:{self.metrics_port}/metrics"


@dataclass(frozen=True)
class FleetPlan:
    nodes: tuple
    router: RouterPlan
    reasons: tuple = ()
    schema_version: int = 1

    def to_json(self) -> dict:
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_json(cls, d: dict, where: str = "fleet plan") -> "FleetPlan":
        try:
            nodes = tuple(Node(host=n["host"], port=int(n["port"]), name=n.get("name", ""),
                               status_port=int(n.get("status_port", 0)), scheme=n.get("scheme", "http"))
                          for n in d["nodes"])
            if any(n.scheme not in ("http", "https") for n in nodes):
                raise ValueError("a node's scheme must be http or https")
            r = dict(d["router"])
            r["argv"] = tuple(r.get("argv", ()))
            router = RouterPlan(**r)
        except (KeyError, TypeError, ValueError) as exc:
            raise FleetError(f"{where}: not a pdctl fleet plan ({type(exc).__name__}: {exc}); "
                             "write one with `pdctl fleet plan --node HOST[:PORT] ... --out FILE`") from None
        if "--worker-urls" not in router.argv or not nodes:
            raise FleetError(f"{where}: the router command or the box list is empty; re-create the file with "
                             "`pdctl fleet plan --node HOST[:PORT] ... --out FILE`")
        if int(d.get("schema_version", 1)) != 1:
            raise FleetError(f"{where}: schema_version {d.get('schema_version')} is not supported (expected 1)")
        return cls(nodes=nodes, router=router, reasons=tuple(d.get("reasons", ())))


def _check_host(host: str, where: str) -> str:
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    if not _HOSTNAME.match(host):
        raise FleetError(f"{where}: {host!r} is not a host name or IP address; write HOST[:PORT], e.g. "
                         f"box-a.lan:{C.PROXY_PORT} or 10.0.0.5")
    return host


def _check_port(text: str, where: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise FleetError(f"{where}: port {text!r} is not a number in 1..65535")
    return int(text)


def parse_node(spec: str, where: str = "--node") -> Node:
    """``HOST``, ``HOST:PORT``, ``[V6]:PORT`` or ``NAME=HOST[:PORT]`` -> Node (port defaults to the proxy's 9000);
    ``https://`` before the host for a box with TLS on (``http://`` is the default)."""
    s = spec.strip()
    name = ""
    if "=" in s:
        name, s = (x.strip() for x in s.split("=", 1))
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", name):
            raise FleetError(f"{where} {spec!r}: name {name!r} must be letters, digits, '.', '_' or '-'")
    scheme = "http"
    for pre in ("http://", "https://"):
        if s.lower().startswith(pre):
            scheme, s = pre[:-3], s[len(pre):].rstrip("/")
    if "/" in s:
        raise FleetError(f"{where} {spec!r}: give [https://]HOST[:PORT] without a path")
    if not s:
        raise FleetError(f"{where}: empty node; write HOST[:PORT]")
    if s.startswith("["):
        m = re.fullmatch(r"\[([^\]]+)\](?::(.*))?", s)
        if not m:
            raise FleetError(f"{where} {spec!r}: bad IPv6 form; write [ADDR]:PORT")
        host, port = m.group(1), m.group(2)
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise FleetError(f"{where} {spec!r}: {host!r} is not an IPv6 address") from None
    elif s.count(":") > 1:
        raise FleetError(f"{where} {spec!r}: put an IPv6 address in brackets: [ADDR]:PORT")
    else:
        host, _, port = s.partition(":")
        host = _check_host(host, f"{where} {spec!r}")
        port = port if _ else None
    return Node(host=host, port=_check_port(port, f"{where} {spec!r}") if port is not None else C.PROXY_PORT,
                name=name, scheme=scheme)


def parse_listen(text: str, where: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise FleetError(f"{where} {text!r}: write HOST:PORT, e.g. 0.0.0.0:{C.ROUTER_PORT}")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise FleetError(f"{where} {text!r}: {host!r} must be an IP address to bind (0.0.0.0 for every "
                         "interface, 127.0.0.1 for loopback)") from None
    return host, _check_port(port, f"{where} {text!r}")


def router_argv(r: RouterPlan, nodes: tuple) -> tuple:
    """vllm-router 0.1.17 arguments: regular mode (each box is one OpenAI worker; PD happens inside it)."""
    return (
        "--host", r.host, "--port", str(r.port),
        "--worker-urls", *[n.url for n in nodes],
        "--policy", r.policy,
        "--cache-threshold", f"{r.cache_threshold:g}",
        "--balance-abs-threshold", str(r.balance_abs),
        "--balance-rel-threshold", f"{r.balance_rel:g}",
        "--health-check-endpoint", r.health_path,
        "--health-check-interval-secs", str(r.health_interval_s),
        "--health-check-timeout-secs", str(r.health_timeout_s),
        "--health-failure-threshold", str(r.health_failures),
        "--health-success-threshold", str(r.health_successes),
        "--cb-failure-threshold", str(r.cb_failures),
        "--cb-timeout-duration-secs", str(r.cb_open_s),
        "--retry-max-retries", str(r.retries),
        "--retry-initial-backoff-ms", str(r.retry_backoff_ms),
        "--retry-max-backoff-ms", str(r.retry_max_backoff_ms),
        "--worker-startup-timeout-secs", str(r.startup_timeout_s),
        "--worker-startup-check-interval", str(max(1, r.health_interval_s)),
        "--request-timeout-secs", str(r.request_timeout_s),
        "--prometheus-host", r.metrics_host, "--prometheus-port", str(r.metrics_port),
        "--log-level", "info",
    )


def make_fleet_plan(node_specs: list, policy: str = DEFAULT_POLICY, listen: str = f"0.0.0.0:{C.ROUTER_PORT}",
                    metrics: str = f"127.0.0.1:{C.ROUTER_METRICS_PORT}", version: str = C.ROUTER_VERSION,
                    **router_overrides) -> FleetPlan:
    """Boxes (``HOST[:PORT]`` strings or Nodes) -> FleetPlan with the router command and the reasons."""
    if not node_specs:
        raise FleetError("no boxes: give at least one --node HOST[:PORT] (each box's pdctl proxy, port "
                         f"{C.PROXY_PORT} by default)")
    nodes = tuple(n if isinstance(n, Node) else parse_node(n) for n in node_specs)
    seen: dict = {}
    for n in nodes:
        if n.hostport in seen:
            raise FleetError(f"--node {n.hostport} is given twice; each box once")
        seen[n.hostport] = n
    names = [n.label for n in nodes]
    if len(set(names)) != len(names):
        raise FleetError(f"box names repeat ({', '.join(names)}); give each NAME=HOST[:PORT] a distinct name")
    if policy not in POLICIES:
        raise FleetError(f"--policy {policy!r} is not one of {', '.join(POLICIES)} (vllm-router "
                         f"{version} policies that need no engine KV events)")
    host, port = parse_listen(listen, "--listen")
    mhost, mport = parse_listen(metrics, "--metrics")
    if (mhost, mport) == (host, port) or (mport == port and "0.0.0.0" in (host, mhost)):
        raise FleetError(f"--metrics {metrics} collides with --listen {listen}; give the metrics another port")
    r = RouterPlan(version=version, host=host, port=port, metrics_host=mhost, metrics_port=mport, policy=policy,
                   **router_overrides)
    if r.cb_failures < 1 or r.retries < 1 or r.health_interval_s < 1 or r.health_timeout_s < 1:
        raise FleetError("router thresholds must be >= 1 (breaker failures, retries, health interval/timeout)")
    if r.balance_abs < 0 or r.balance_rel < 1:
        raise FleetError("cache_aware balance thresholds: balance_abs must be >= 0 and balance_rel >= 1")
    r = RouterPlan(**{**asdict(r), "argv": router_argv(r, nodes)})
    reasons = [
        f"one router (vllm-router {version}) in regular mode: each box's proxy is one OpenAI worker; prefill/"
        "decode disaggregation and the shared LMCache L1 stay inside each box (CUDA IPC does not cross hosts)",
        {"cache_aware": "policy cache_aware: a prompt whose prefix the router sent to a box before goes to that "
                        f"box while the match is > {r.cache_threshold:g} of the prompt and loads are balanced "
                        "(the box's L1 already holds it); it reads the prompt's tokens from each box's render routes; "
                        f"once the boxes' requests in flight differ by more than {r.balance_abs} and "
                        f"{r.balance_rel:g}x, it sends to the least loaded box instead",
         "consistent_hash": "policy consistent_hash: X-Session-Id / the request's user field pins a session to "
                            "one box (its L1 keeps the conversation)",
         }.get(policy, f"policy {policy}: load only, no cache affinity (boxes recompute shared prefixes)"),
        f"health: {r.health_path} every {r.health_interval_s} s, out after {r.health_failures} failures; "
        f"{r.health_path} is 200 only while the box's PD canary passes",
        f"failover: up to {r.retries} attempts before the first byte ({r.retry_backoff_ms}-{r.retry_max_backoff_ms} ms "
        f"apart); {r.cb_failures} failures (connection errors, 5xx) open a box's breaker for {r.cb_open_s} s so the "
        "next attempt lands on another box",
        "box refusals: set [admission] status = 429 on every box behind the router: vllm-router "
        f"{version} retries a 429 (up to {r.retries} attempts) without counting it against the box's breaker and "
        "passes the last box's Retry-After to the client; a 503 counts as a failure, and two of them make the "
        "router refuse everything itself for the breaker's open time (benchmarks/fleet_overload.py)",
        "clients send the boxes' API key; vllm-router passes Authorization through (all boxes share one key)",
        f"router metrics on {mhost}:{mport} (Prometheus)",
    ]
    if len(nodes) == 1:
        reasons.append("only one box: the router adds a hop and no capacity; it is useful only as a stable front "
                       "address while more boxes are added")
    return FleetPlan(nodes=nodes, router=r, reasons=tuple(reasons))
