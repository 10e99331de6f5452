"""``pdctl status`` and ``pdctl logs``: the operator's views of one installed box. ``pdctl tui`` lives in tui/ and
reads the settings, plan and fleet through the helpers here (settings_value, front_node, box_plan_here)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

from appliance import constants as C
from appliance.errors import EXIT_BAD, EXIT_FAIL, EXIT_OK


def settings_value(config: Path, section: str, key: str) -> Optional[Any]:
    """A value from pdctl.toml when that file exists (the TUI refresh and TTFT SLO live there)."""
    if config.suffix != ".toml" or not config.exists():
        return None
    try:
        from appliance.settings.config import resolve
        return resolve(config).get(section, key)
    except Exception:  # noqa: BLE001 - a bad settings file is reported by `pdctl config show`, not here
        return None


def _plan(config: Path) -> Any:
    from appliance.plan.installed import load_plan
    return load_plan(config)


def front_node(config: Path):
    """On a fleet front node (a fleet plan next to the settings): (FleetPlan, API key or None); else None.
    Raises FleetError for a fleet plan that does not load."""
    fleet_file = Path(config).parent / C.FLEET_PLAN.name
    if not fleet_file.exists():
        return None
    from appliance.fleet.install import load_fleet
    key = None
    key_file = settings_value(config, "proxy", "api_key_file")
    if key_file:
        try:
            key = Path(key_file).read_text().strip()
        except OSError as e:
            print(f"pdctl: [proxy] api_key_file {key_file}: {e.strerror or e}; reading the boxes without a key "
                  "(their /pdctl/status answers 401)", file=sys.stderr)
    return load_fleet(fleet_file), key


def box_plan_here(config: Path) -> bool:
    """A box plan beside the settings (or the settings are a plan): not a pure front node."""
    return Path(config).with_name("plan.json").exists() or Path(config).suffix == ".json"


def cmd_status(args: argparse.Namespace) -> int:
    from appliance.collector import collect_once
    from appliance.fleet.plan import FleetError
    from appliance.views.status import render_json, render_text
    try:
        front = front_node(args.config)
    except FleetError as exc:
        print(f"pdctl status: {exc}", file=sys.stderr)
        return EXIT_BAD
    fleet = None
    if front is not None:
        from appliance.fleet.status import collect
        fleet = collect(front[0], api_key=front[1], timeout=max(args.timeout, 1.0))
    has_plan = box_plan_here(args.config)
    if fleet is not None and not has_plan:     # a pure front node: only the fleet
        import json as _json

        from appliance.fleet.status import render_text as fleet_text
        sys.stdout.write(_json.dumps(fleet.to_json(), indent=2) + "\n" if args.json else fleet_text(fleet))
        return EXIT_OK if all(b.ready == "ready" for b in fleet.boxes) else EXIT_FAIL
    plan = _plan(args.config)
    if getattr(args, "keys", False):
        return _keys_status(args, plan)
    slo = settings_value(args.config, "workload", "ttft_slo_s")
    tpot_ms = settings_value(args.config, "workload", "tpot_slo_ms")
    snap = collect_once(plan, settle_s=max(0.0, args.window), slo_ttft_s=slo, timeout_s=args.timeout,
                        slo_tpot_s=tpot_ms / 1000.0 if tpot_ms else None)
    sys.stdout.write(render_json(snap) + "\n" if args.json else render_text(snap))
    if fleet is not None and not args.json:
        from appliance.fleet.status import render_text as fleet_text
        sys.stdout.write("\nfleet:\n" + fleet_text(fleet))
    # a rollout in progress (`sudo pdctl apply`) serves from the other workers: no alarm (its line says how far)
    return EXIT_OK if snap.overall in ("ready", "rolling") else EXIT_FAIL


def _keys_status(args: argparse.Namespace, plan) -> int:
    """``pdctl status --keys``: the proxy's per-key counts (loopback status) beside the keys file's classes and
    limits; exit 1 when the proxy does not answer."""
    import json as _json
    import urllib.request
    from appliance.views.keys_table import render, rows
    url = f"http://{C.LOOPBACK}:{plan.proxy.internal_port}{C.BOX_STATUS_PATH}"
    try:
        with urllib.request.urlopen(url, timeout=max(args.timeout, 2.0)) as r:
            live = _json.loads(r.read()).get("keys", {})
    except (OSError, ValueError) as e:
        print(f"pdctl status --keys: the proxy's status ({url}) did not answer ({e}); is pd-proxy running? "
              "`systemctl status pd-proxy`", file=sys.stderr)
        return EXIT_FAIL
    table, why = None, ""
    path = getattr(plan.proxy, "keys_file", "")
    if path:
        from appliance.keys.table import KeysError, load
        try:
            table = load(Path(path))
        except KeysError as e:
            why = str(e)
    else:
        why = "[proxy] keys_file is not set"
    if args.json:
        sys.stdout.write(_json.dumps({"keys": rows(live, table), "file_note": why}, indent=2) + "\n")
    else:
        sys.stdout.write(render(live, table, why))
    return EXIT_OK


def cmd_logs(args: argparse.Namespace) -> int:
    from appliance.views import journal
    instances: list = []
    try:
        instances = [w.instance for w in _plan(args.config).workers]
    except Exception:  # noqa: BLE001 - logs must work even when the plan is unreadable
        instances = []
    if args.audit or args.key:
        return _audit_logs(args)
    names = args.target or ["all"]
    units = [journal.resolve_unit(n, instances) for n in names]
    if units == [C.TARGET_UNIT]:
        units = [C.KV_UNIT, C.PROXY_UNIT] + [C.worker_unit(i) for i in instances] if instances else \
            [C.KV_UNIT, C.PROXY_UNIT, "pd-worker@*.service"]
    return _print_journal(args, units, priority=args.priority)


def _print_journal(args: argparse.Namespace, units: list, priority: str = "", matches: tuple = ()) -> int:
    """The journal lines of ``units`` (and ``matches``) to stdout, followed with ``-f``; errors as exit codes."""
    from appliance.views import journal
    try:
        if args.follow:
            for ln in journal.follow(units, since=args.since, lines=args.lines, matches=matches):
                print(ln.render(), flush=True)
            return EXIT_OK
        lines, err = journal.read(units, since=args.since, lines=args.lines, priority=priority, matches=matches)
    except ValueError as e:
        print(f"pdctl logs: {e}", file=sys.stderr)
        return EXIT_BAD
    except KeyboardInterrupt:
        return EXIT_OK
    if err:
        print(f"pdctl logs: {err}", file=sys.stderr)
        return EXIT_FAIL
    for ln in lines:
        print(ln.render())
    return EXIT_OK


def _audit_logs(args: argparse.Namespace) -> int:
    """``pdctl logs --audit [--key NAME]``: the audit trail (one entry per request while keys are on, one per key
    change; keys/audit.py), from the journal by its fields, whichever unit wrote them."""
    from appliance.keys.audit import IDENT
    if args.target:
        print("pdctl logs: --audit reads the audit entries of every unit: drop the target "
              f"({' '.join(args.target)})", file=sys.stderr)
        return EXIT_BAD
    matches = (f"SYSLOG_IDENTIFIER={IDENT}",) + ((f"PDCTL_KEY={args.key}",) if args.key else ())
    return _print_journal(args, [], matches=matches)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="one-shot state of the box: roles, GPUs, KV hit rates, TTFT")
    p.add_argument("--json", action="store_true", help="the Snapshot as JSON (NA values as {\"na\": reason})")
    p.add_argument("--config", type=Path, default=C.CONFIG_PATH, help="pdctl.toml or plan.json")
    p.add_argument("--window", type=float, default=1.0, help="seconds between the two samples rates come from")
    p.add_argument("--timeout", type=float, default=0.5, help="per-endpoint HTTP time-out (s)")
    p.add_argument("--keys", action="store_true", help="each named key's use now (requests and tokens per minute, "
                                                      "today, refusals) beside its class and limits")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("logs", help="journal of a role or unit: prefill-0, decode, proxy, kv, or a unit name")
    p.add_argument("target", nargs="*", help="instance, role, proxy, kv, all, or a unit name (default all)")
    p.add_argument("-f", "--follow", action="store_true")
    p.add_argument("--since", default="", help="journalctl --since (e.g. -10min, today)")
    p.add_argument("-n", "--lines", type=int, default=200)
    p.add_argument("-p", "--priority", default="", help="emerg..debug or 0-7 (that level and more severe)")
    p.add_argument("--audit", action="store_true", help="the audit trail: one entry per request on the public port while "
                                                        "keys are on, one per `pdctl keys` change")
    p.add_argument("--key", default="", metavar="NAME", help="--audit entries of this key only")
    p.add_argument("--config", type=Path, default=C.CONFIG_PATH, help="pdctl.toml or plan.json")
    p.set_defaults(func=cmd_logs)
