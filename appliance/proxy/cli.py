"""``pdctl proxy``: run the proxy from the installed Plan, or standalone with explicit backends."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from dataclasses import replace
from pathlib import Path

from .. import constants as C
from ..policy import admit as A
from ..settings.schema import default as _d
from .config import BackendSpec, ProxyConfig, from_plan
from .routing import POLICIES


def _hostport(value: str) -> tuple:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r}: expected HOST:PORT, e.g. {C.LOOPBACK}:9300")
    return host or C.ALL_INTERFACES, int(port)


def _url(value: str) -> str:
    v = value.rstrip("/")
    if not v.startswith("http://") or not v[7:]:
        raise argparse.ArgumentTypeError(f"{value!r}: expected an engine URL like "
                                         f"{C.loopback_url(C.PREFILL_PORT_BASE)} (engines are reached over plain "
                                         "HTTP on loopback)")
    return v


def register(subparsers) -> None:
    p = subparsers.add_parser("proxy", help="run the disaggregation proxy (from the Plan, or standalone "
                                            "with --prefill/--decode)")
    p.add_argument("--listen", type=_hostport, help="public HOST:PORT (default: the Plan's, or "
                                                      f"{_d('proxy', 'host')}:{C.PROXY_PORT})")
    p.add_argument("--internal", type=_hostport,
                   help="loopback HOST:PORT for telemetry and /pdctl/status (default: the Plan's, or "
                        f"{C.LOOPBACK}:{C.PROXY_INTERNAL_PORT}; port 0 picks a free one)")
    p.add_argument("--prefill", type=_url, action="append", default=[], metavar="URL")
    p.add_argument("--decode", type=_url, action="append", default=[], metavar="URL")
    p.add_argument("--both", type=_url, action="append", default=[], metavar="URL",
                   help="kv_both workers: whole requests, P legs and D legs (soft roles)")
    p.add_argument("--policy", choices=tuple(POLICIES), help="adaptive (default), pdctl or round-robin")
    p.add_argument("--aggregate-max-uncached", type=int, metavar="TOKENS",
                   help="adaptive: aggregate while at most this many prompt tokens are uncached")
    p.add_argument("--split-max-prefill-backlog", type=int, metavar="TOKENS",
                   help="adaptive: split only while the prefiller's backlog stays under this")
    p.add_argument("--split-idle-max-running", type=int, metavar="N",
                   help="adaptive: a both-worker takes P legs only while running at most N sequences")
    p.add_argument("--consumer-max-uncached", type=int, metavar="TOKENS",
                   help="adaptive: a decode-only worker serves a whole request only up to this many uncached")
    p.add_argument("--warm-min-tokens", type=int, metavar="TOKENS",
                   help="adaptive: prefer the worker whose own prefix cache holds this many more of the prompt "
                        "than the least-loaded one (a conversation's next turn; default 512; 0 = off: load alone)")
    p.add_argument("--warm-max-extra-load", type=float, metavar="LOAD",
                   help="adaptive: ... while that warm worker is at most this much busier than the least-loaded "
                        "(default 16)")
    p.add_argument("--config", type=Path, default=C.CONFIG_PATH, help="pdctl.toml (its plan.json is read)")
    p.add_argument("--api-key-file", type=Path, help="file holding the key clients must send as Bearer")
    p.add_argument("--keys-file", type=Path, help="named keys with classes and limits ([proxy] keys_file; "
                                                  "`pdctl keys` edits it)")
    p.add_argument("--tls-cert-file", type=Path, help="TLS on the public port: certificate chain in PEM "
                                                      "([proxy] tls_cert_file)")
    p.add_argument("--tls-key-file", type=Path, help="its private key in PEM ([proxy] tls_key_file)")
    p.add_argument("--tls-client-ca-file", type=Path, help="mutual TLS: the CA of the clients' certificates "
                                                           "([proxy] tls_client_ca_file)")
    p.add_argument("--backend-api-key-file", type=Path, help="file holding the engines' --api-key")
    p.add_argument("--control-token-file", type=Path, help="where the proxy writes its control secret (draining a "
                                                           "worker, control.py; default with a plan: "
                                                           f"{C.PROXY_CONTROL_TOKEN}; standalone: none)")
    p.add_argument("--kv-wait-s", type=float, help="bounded wait for LMCache's store-finished event")
    p.add_argument("--telemetry-prefill", action="store_true",
                   help="standalone: the prefillers post LMCache request telemetry to --internal")
    p.add_argument("--pd-min-prompt-tokens", type=int, help="shorter prompts skip the P leg")
    p.add_argument("--first-byte-timeout-s", type=float)
    p.add_argument("--max-body-bytes", type=int)
    p.add_argument("--stall-floor-s", type=float, help="the shortest silence of a worker with open legs that counts "
                   "as hung ([proxy] stall_floor_s)")
    p.add_argument("--on-prefill-failure", choices=("fail", "decode"))
    p.add_argument("--public-status", action="store_true",
                   help="also serve /pdctl/status on the public port (read-only, API key required)")
    p.add_argument("--admission", choices=A.MODES, help="admission by the SLO: slo (default), queue or off "
                                                        "([admission] mode)")
    p.add_argument("--ttft-slo-s", type=float, metavar="S", help="the TTFT SLO admission admits by "
                                                                 "([workload] ttft_slo_s)")
    p.add_argument("--tpot-slo-ms", type=float, metavar="MS", help="the TPOT SLO admission admits by "
                                                                   "([workload] tpot_slo_ms)")
    p.add_argument("--max-num-seqs", type=int, metavar="N", help="the engines' --max-num-seqs (streams per "
                                                                 "worker at most)")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(func=main)


def _read_key(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        key = path.read_text().strip()
    except OSError as e:
        raise SystemExit(f"pdctl proxy: cannot read key file {path}: {e.strerror}")
    if key.startswith("PDCTL_API_KEY="):
        key = key.split("=", 1)[1].strip().strip('"')
    if not key:
        raise SystemExit(f"pdctl proxy: key file {path} is empty; write the key into it or drop the flag")
    return key


def _read_keys(path: Path | None):
    """The named keys (appliance/keys/table.py); a bad file stops the proxy (at a reload: keeps the old keys)."""
    if path is None:
        return None
    from ..keys.table import KeysError, load
    try:
        return load(path)
    except KeysError as e:
        raise SystemExit(f"pdctl proxy: {e}") from None


def config_from_args(args, plan=None) -> ProxyConfig:
    if args.prefill or args.decode or args.both:
        tel = args.telemetry_prefill
        specs = ([BackendSpec(u, "prefill", telemetry=tel) for u in args.prefill]
                 + [BackendSpec(u, "decode") for u in args.decode]
                 + [BackendSpec(u, "both", telemetry=tel) for u in args.both])
        if not args.decode and not args.both:
            raise SystemExit("pdctl proxy: give at least one --decode (or --both) URL")
        cfg = ProxyConfig(backends=tuple(specs), kv_wait_s=_d("proxy", "kv_wait_s") if tel else 0.0)
    else:
        cfg = from_plan(plan)
    kw = {}
    if args.listen:
        kw["host"], kw["port"] = args.listen
    if args.internal:
        kw["internal_host"], kw["internal_port"] = args.internal
    for k in ("policy", "kv_wait_s", "pd_min_prompt_tokens", "first_byte_timeout_s", "max_body_bytes",
              "on_prefill_failure", "stall_floor_s"):
        v = getattr(args, k)
        if v is not None:
            kw[k] = v
    for k in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
        v = getattr(args, k, None)
        if v is not None:
            kw[k] = str(Path(v).absolute())
    th = {f: getattr(args, f) for f in ("aggregate_max_uncached", "split_max_prefill_backlog",
                                        "split_idle_max_running", "consumer_max_uncached", "warm_min_tokens",
                                        "warm_max_extra_load")
          if getattr(args, f) is not None}
    for f, v in th.items():
        if v < 0:
            raise SystemExit(f"pdctl proxy: --{f.replace('_', '-')} {v:g}: must be >= 0")
    if th:
        kw["thresholds"] = replace(cfg.thresholds, **th)
    kw["api_key"] = _read_key(args.api_key_file)
    kw["keys"] = _read_keys(getattr(args, "keys_file", None))
    if getattr(args, "public_status", False):
        kw["public_status"] = True
    if (kw.get("public_status") or cfg.public_status) and not kw["api_key"] and kw["keys"] is None:
        raise SystemExit("pdctl proxy: the public status endpoint needs an API key: pass --api-key-file or "
                         "--keys-file (or set [proxy] api_key_file or keys_file), or turn public_status off")
    kw["backend_api_key"] = _read_key(args.backend_api_key_file)
    if getattr(args, "control_token_file", None) is not None:
        kw["control_token_file"] = str(Path(args.control_token_file).absolute())
    adm = {}
    if getattr(args, "admission", None):
        adm["mode"] = args.admission
    for flag, key, scale in (("ttft_slo_s", "ttft_slo_s", 1.0), ("tpot_slo_ms", "tpot_slo_s", 0.001)):
        v = getattr(args, flag, None)
        if v is not None:
            if not v > 0:
                raise SystemExit(f"pdctl proxy: --{flag.replace('_', '-')} must be > 0, got {v}")
            adm[key] = v * scale
    if adm:
        kw["admission"] = replace(cfg.admission, **adm)
    if getattr(args, "max_num_seqs", None) is not None:
        if args.max_num_seqs < 1:
            raise SystemExit(f"pdctl proxy: --max-num-seqs must be >= 1, got {args.max_num_seqs}")
        kw["max_num_seqs"] = args.max_num_seqs
    return replace(cfg, **kw)


async def serve(cfg: ProxyConfig, stop: asyncio.Event | None = None, reread=None) -> None:
    """Run until ``stop`` is set (or SIGTERM/SIGINT), then drain; tells systemd READY=1 once both ports listen.

    Sockets passed by systemd (pd-proxy.socket) are used instead of binding. SIGTERM/SIGINT drain (stop
    accepting, finish in-flight answers up to ``drain_timeout_s``) before exiting; SIGHUP calls ``reread``
    (a fresh ProxyConfig from the plan) and applies it with ``ProxyServer.reload``. With ``WATCHDOG_USEC`` set
    the proxy pings systemd only while its own /health answers (lifecycle.watchdog_loop).
    """
    from .. import sdnotify
    from . import lifecycle
    from .app import ProxyServer
    server = ProxyServer(cfg)
    server.sockets = lifecycle.adopt(sdnotify.listen_fds(), cfg)
    adopted = sorted(server.sockets)
    try:
        await server.start()
    except ValueError as e:      # tls.TlsError: a certificate file it cannot use, named
        await server.stop()
        raise SystemExit(f"pdctl proxy: {e}") from None
    except OSError as e:
        await server.stop()
        raise SystemExit(f"pdctl proxy: cannot listen on {cfg.host}:{cfg.port} or {cfg.internal_host}:"
                         f"{cfg.internal_port}: {e.strerror or e}; is another proxy running (systemctl status "
                         f"{C.PROXY_UNIT})? Pick other ports with --listen/--internal")
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    log = logging.getLogger("pdctl.proxy")
    handled = []

    def on_hup() -> None:
        loop.create_task(_reload(server, reread, log))
    for sig, fn in ((signal.SIGTERM, stop.set), (signal.SIGINT, stop.set), (signal.SIGHUP, on_hup)):
        try:
            loop.add_signal_handler(sig, fn)
            handled.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
    how = f"sockets from systemd: {', '.join(adopted)}" if adopted else "bound by itself"
    log.warning("pdctl proxy listening on %s:%s%s (internal %s:%s; %s), policy %s", cfg.host, server.public_port,
                " over TLS" + (" (mutual)" if cfg.tls_client_ca_file else "") if cfg.tls_cert_file else "",
                cfg.internal_host, server.internal_port, how, cfg.policy)
    sdnotify.ready(lifecycle.serving_status(server))
    period = sdnotify.watchdog_period()
    wd = loop.create_task(lifecycle.watchdog_loop(server, period)) if period else None
    try:
        await stop.wait()
        sdnotify.stopping(f"draining: finishing answers in flight (up to {server.cfg.drain_timeout_s:g} s)")
        seen = await server.drain(server.cfg.drain_timeout_s)
        log.warning("pdctl proxy drained: %s", seen)
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        if wd is not None:
            wd.cancel()
        sdnotify.stopping("proxy shutting down")
        await server.stop()


async def _reload(server, reread, log) -> None:
    """SIGHUP: RELOADING=1, re-read the plan, apply it, READY=1 (a bad plan leaves the old one in force)."""
    from .. import sdnotify
    from . import lifecycle
    sdnotify.reloading("re-reading the plan")
    try:
        if reread is None:
            raise ValueError("this proxy was started without a plan to re-read")
        new = reread()
        changes = server.reload(new)
        log.warning("pdctl proxy reloaded: %s", "; ".join(changes) or "nothing changed")
        sdnotify.ready(lifecycle.serving_status(server))
    except (SystemExit, ValueError, OSError) as e:    # ConfigError is a ValueError
        log.error("pdctl proxy reload failed, the old configuration stays in force: %s", e)
        sdnotify.ready(f"{lifecycle.serving_status(server)}; last reload failed: {e}")


async def serve_plan(plan, stop: asyncio.Event | None = None, **overrides) -> None:
    """The appliance entry point: the proxy exactly as the Plan describes it."""
    await serve(from_plan(plan, **overrides), stop)


def _run(coro) -> None:
    try:
        import uvloop
        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


def run_from_plan(plan, **overrides) -> None:
    _run(serve_plan(plan, **overrides))


def main(args) -> int:
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    key_flag, keys_flag = args.api_key_file, args.keys_file

    def build() -> ProxyConfig:
        """The config from the flags and (appliance mode) the installed plan; called again on SIGHUP."""
        plan = None
        if not (args.prefill or args.decode or args.both):
            from ..plan.installed import load_plan
            from ..settings.config import resolve
            plan = load_plan(args.config)
            if key_flag is None:      # the plan's (from [proxy] api_key_file), unless a flag overrides
                key_file = plan.proxy.api_key_file or (resolve(Path(args.config)).get("proxy", "api_key_file")
                                                       if Path(args.config).suffix == ".toml" else "")
                args.api_key_file = Path(key_file) if key_file else None
            if keys_flag is None:     # the plan's [proxy] keys_file, re-read at every SIGHUP (`pdctl keys`)
                keys_file = getattr(plan.proxy, "keys_file", "")
                args.keys_file = Path(keys_file) if keys_file else None
        return config_from_args(args, plan)
    _run(serve(build(), reread=build))
    return 0
