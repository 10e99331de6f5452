"""The proxy's life under systemd: sockets handed over, limits of its listeners, reload, drain and watchdog.

Why: a proxy restart must refuse nobody. ``pd-proxy.socket`` holds the listening sockets, so connections
that arrive while the proxy restarts wait in the kernel's backlog; the proxy takes them from
``LISTEN_FDS`` (``adopt``) and binds itself only when none are passed (standalone, demo, tests). A stop
drains (``ProxyServer.drain``), a ``SIGHUP`` re-reads the plan without dropping a connection (``reload``:
unchanged backends keep their breakers and pools), and the watchdog pings systemd only while the proxy's
own ``/health`` answers through its own listener.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from dataclasses import fields, replace

from .. import constants as C, sdnotify
from ..keys import tls
from . import guard
from .backends import Backend
from .routing import POLICIES, make_policy
from ..wire.server import Limits

log = logging.getLogger("pdctl.proxy")
PUBLIC, INTERNAL = "public", "internal"
INTERNAL_MAX_BODY = 4 * 1024 * 1024     # telemetry events and status reads only


def limits(cfg, which: str = PUBLIC) -> Limits:
    """The listener limits from the config ([listener]); the loopback port takes small bodies only."""
    kw = {f.name: getattr(cfg, f.name) for f in fields(Limits)}
    if which != PUBLIC:
        kw["max_body_bytes"] = INTERNAL_MAX_BODY
        kw["max_connections_per_address"] = 0      # every client of the loopback port has the same address
    return Limits(**kw)


def tls_context(cfg):
    """The public port's TLS context from [proxy] tls_* (None: plain HTTP); TlsError (a ValueError) names the file."""
    files = tls.TlsFiles.of(cfg)
    return tls.server_context(files) if files.on or files.incomplete() else None


def tls_end(cfg) -> str:
    """The certificate's end as /pdctl/status shows it, read when its context is built (start, reload)."""
    try:
        return tls.not_after(cfg.tls_cert_file).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (OSError, ValueError) as e:
        return f"unreadable: {e}"


def tls_status(server) -> dict:
    """What /pdctl/status says of TLS: on or off, mutual or not, the certificate in force and its end."""
    files = tls.TlsFiles.of(server.cfg)
    if not files.on:
        return {"on": False}
    return {"on": True, "mutual": files.mutual, "cert_file": files.cert_file, "not_after": server.tls_end}


def adopt(fds: list, cfg) -> dict:
    """Match sockets passed by systemd (``sdnotify.listen_fds``) to the proxy's two listeners.

    By name when the socket unit named them ``public``/``internal``, else by the port each is bound to
    (one socket unit holding both ports names them alike). A socket that matches neither is closed, with a
    warning: the plan's port changed without the socket unit (``pdctl apply`` restarts it then).
    """
    out: dict = {}
    for fd, name in fds:
        try:
            sock = socket.socket(fileno=fd)
        except OSError as e:
            log.warning("socket activation: fd %d (%s) is not a socket: %s", fd, name, e)
            continue
        try:
            port = sock.getsockname()[1]
        except (OSError, IndexError, TypeError):
            port = None
        which = name if name in (PUBLIC, INTERNAL) else (
            PUBLIC if port == cfg.port else INTERNAL if port == cfg.internal_port else None)
        if which is None or which in out or sock.type != socket.SOCK_STREAM:
            log.warning("socket activation: fd %d (%s, port %s) matches neither the public port %s nor the "
                        "internal port %s; ignoring it and binding myself", fd, name, port, cfg.port,
                        cfg.internal_port)
            sock.close()
            continue
        sock.setblocking(False)
        out[which] = sock
    return out


def reload(server, new) -> list[str]:
    """Apply a re-read plan to a running proxy; returns what changed (one line each).

    Backends are matched by URL: an unchanged one keeps its Backend (breaker, pools, scraped load, counters);
    a new one starts closed; a removed one leaves the routing at once and its connections close when its
    legs in flight have ended. Listen addresses cannot change here (the socket unit owns them): such a
    change is reported and needs ``systemctl restart pd-proxy.socket pd-proxy``. Raises ValueError for a
    config the proxy cannot run (the old one stays in force).
    """
    old = server.cfg
    if new.policy not in POLICIES:
        raise ValueError(f"unknown proxy policy {new.policy!r}: choose one of {', '.join(POLICIES)}")
    ctx = tls_context(new)          # the files are read again (a renewed certificate); a bad one keeps the old
    changes = []
    pub = server._servers[0] if server._servers else None
    tls_why = pub.tls_change(ctx) if pub is not None and (ctx is not None or pub.ssl is not None) else ""
    if tls_why:                     # TLS on/off or mutual TLS: the listener is made anew by a restart
        changes.append(f"TLS: kept as it was ({tls_why}): `systemctl restart pd-proxy` applies it (clients wait "
                       "in pd-proxy.socket's backlog, answers in flight finish first)")
        new = replace(new, **{k: getattr(old, k) for k in tls.CONFIG_KEYS})
        ctx = None
    where = ("host", "port", "internal_host", "internal_port")
    if any(getattr(new, k) != getattr(old, k) for k in where):
        changes.append("listen addresses changed (" + ", ".join(f"{k} {getattr(old, k)} -> {getattr(new, k)}"
                                                                for k in where if getattr(new, k) != getattr(old, k))
                       + "): kept the old ones; `systemctl restart pd-proxy.socket pd-proxy` applies them")
        new = replace(new, **{k: getattr(old, k) for k in where})
    by_url = {b.spec.url: b for b in server.backends}
    backends = []
    for spec in new.backends:
        b = by_url.pop(spec.url, None)
        if b is None:
            b = Backend.from_config(spec, new)
            changes.append(f"added backend {spec.label} ({spec.role}, {spec.url})")
        elif b.spec != spec:
            changes.append(f"backend {spec.label}: {b.spec.role} -> {spec.role}" if b.spec.role != spec.role
                           else f"backend {spec.label}: updated")
            b.spec = spec
        backends.append(b)
    for b in by_url.values():
        changes.append(f"removed backend {b.label} ({b.url})")
        asyncio.get_running_loop().create_task(_retire(b, new.drain_timeout_s))
    policy = make_policy(new, backends, server.prefix, lambda: server.chars_per_token.value, server.warm)
    if new.policy != old.policy or new.thresholds != old.thresholds \
            or new.pd_min_prompt_tokens != old.pd_min_prompt_tokens:
        changes.append(f"policy {new.policy}, thresholds {new.thresholds}, pd_min_prompt_tokens "
                       f"{new.pd_min_prompt_tokens}")
    changed_keys = sorted(k for k in new.__dataclass_fields__ if k not in ("backends", "thresholds", "policy",
                                                                         "pd_min_prompt_tokens", *where)
                          and getattr(new, k) != getattr(old, k))
    if changed_keys:
        changes.append("settings: " + ", ".join(k for k in changed_keys if "key" not in k)
                       + (" (API keys re-read)" if any("key" in k for k in changed_keys) else ""))
    server.backends, server.policy, server.cfg = backends, policy, new
    server.warm.ttl_s = server.sessions.ttl_s = new.warm_ttl_s     # the indices (and what they hold) are kept
    server.keyring = guard.keyring(new)        # a revoked key fails from the next request on; open streams finish
    if new.admission != old.admission or new.admission_prior != old.admission_prior:
        changes.append(f"admission: mode {new.admission.mode}, target {new.admission.target}, max_queue "
                       f"{new.admission.max_queue}")
    server.gate.reconfigure(new.admission, new.admission_prior)
    server._public.pop(("GET", C.BOX_STATUS_PATH), None)
    if new.public_status:
        server._public[("GET", C.BOX_STATUS_PATH)] = server.h_public_status
    for srv, which in zip(server._servers, (PUBLIC, INTERNAL)):
        srv.set_limits(limits(new, which))
    if pub is not None and ctx is not None:
        pub.set_ssl(ctx)
        server.tls_end = tls_end(new)
        changes.append(f"TLS on -> on (certificate {new.tls_cert_file} read again): new connections from now on, "
                       "open ones keep theirs")
    return changes


async def _retire(b, grace_s: float) -> None:
    """A backend that left the plan: close its connections once its legs in flight have ended (bounded)."""
    deadline = time.monotonic() + max(1.0, grace_s)
    while (b.inflight or b.pending) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    b.pool.close()
    b.probe_pool.close()


def serving_status(server) -> str:
    """The STATUS= line while serving (systemctl status pd-proxy)."""
    return f"proxy on :{server.public_port}, {len(server.backends)} backends, policy {server.cfg.policy}"


def _own_client_tls():
    """The watchdog's TLS client for our own listener: it asks whether the loop answers, not who we are."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


async def own_health(host: str, port: int, timeout_s: float, tls_on: bool = False, mutual: bool = False) -> str:
    """'' when GET /health through our own listener answers 200 within ``timeout_s``, else why not. Over TLS the
    probe speaks TLS; with mutual TLS it has no client certificate, so the listener's refusal (a TLS alert) proves
    the loop and the listener alive as well."""
    target = C.LOOPBACK if host in (C.ALL_INTERFACES, "") else "::1" if host == "::" else host
    try:
        r, w = await asyncio.wait_for(asyncio.open_connection(
            target, port, **({"ssl": _own_client_tls(), "server_hostname": ""} if tls_on else {})), timeout_s)
    except ssl.SSLError:
        if mutual:
            return ""
        return f"TLS handshake with {target}:{port} failed"
    except (OSError, asyncio.TimeoutError) as e:
        return f"connect to {target}:{port}: {e or 'timed out'}"
    try:
        w.write(b"GET /health HTTP/1.1\r\nHost: watchdog\r\nConnection: close\r\n\r\n")
        line = await asyncio.wait_for(r.readline(), timeout_s)
        if line.startswith(b"HTTP/1.1 200") or (mutual and not line):
            return ""
        return f"/health answered {line[:40]!r}"
    except ssl.SSLError:
        return "" if mutual else "TLS error on /health"
    except (OSError, asyncio.TimeoutError) as e:
        return f"/health gave no answer within {timeout_s:g} s ({type(e).__name__})"
    finally:
        w.close()


async def watchdog_loop(server, period_s: float) -> None:
    """WATCHDOG=1 every ``period_s`` while /health answers through the public and the internal listener
    within the period: a wedged event loop or a listener that stopped accepting stops the pings, and
    systemd restarts the proxy (WatchdogSec). A client flood at max_connections answers 503, which still
    proves the loop and the listener alive, so it does not count against the proxy (nor does the 429 of the
    per-address cap, when a flood comes from loopback too)."""
    failing = False
    while True:
        t0 = time.monotonic()
        pub = server._servers[0].ssl if server._servers else None
        why = await own_health(server.cfg.host, server.public_port, period_s, tls_on=pub is not None,
                               mutual=pub is not None and pub.verify_mode == ssl.CERT_REQUIRED)
        if why.startswith(("/health answered b'HTTP/1.1 503", "/health answered b'HTTP/1.1 429")):
            why = ""
        if not why and server.cfg.internal_port:
            why = await own_health(server.cfg.internal_host, server.internal_port, period_s)
        if why:
            log.warning("watchdog: not pinging systemd: %s", why)
            sdnotify.status(f"unhealthy, watchdog pings stopped: {why}")
        else:
            sdnotify.watchdog()
            if failing:
                sdnotify.status(serving_status(server))
        failing = bool(why)
        await asyncio.sleep(max(0.0, period_s - (time.monotonic() - t0)))
