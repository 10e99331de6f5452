"""The UI's verbs: ``pdctl tui`` and the dashboard of ``pdctl demo``.

Why here and not in appliance/: the core stays UI-free; appliance/cli.py finds these verbs through the
``pdctl.verbs`` entry point group (pyproject.toml), so a core without the tui package still runs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from appliance import constants as C
from appliance.errors import EXIT_BAD, EXIT_FAIL, EXIT_OK, CliError
from appliance.views import cli as V


def _app_class():
    """tui.app's PdctlApp, or a CliError that names the missing package (textual) instead of a traceback."""
    try:
        from tui.app import PdctlApp
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in ("textual", "rich"):
            raise
        raise CliError(f"the dashboard needs the {exc.name.split('.')[0]} package, which this Python lacks "
                       f"({sys.executable}); reinstall pdctl with its dependencies. `pdctl status` shows the same "
                       "numbers as text", EXIT_FAIL) from None
    return PdctlApp


def cmd_tui(args: argparse.Namespace) -> int:
    from appliance.fleet.plan import FleetError
    PdctlApp = _app_class()
    refresh = args.refresh or V.settings_value(args.config, "tui", "refresh_s") or 1.0
    if refresh <= 0:
        print(f"pdctl tui: --refresh must be > 0 (got {refresh})", file=sys.stderr)
        return EXIT_BAD
    try:
        front = V.front_node(args.config)
    except FleetError as exc:
        print(f"pdctl tui: {exc}", file=sys.stderr)
        return EXIT_BAD
    fleet = None
    if front is not None:         # HTTP on the watch's own thread, never the UI's
        from appliance.fleet.watch import FleetWatch
        fleet = FleetWatch(front[0], api_key=front[1]).start()
    has_plan = V.box_plan_here(args.config)
    collector = None
    try:
        if fleet is not None and not has_plan:     # a pure front node: the fleet is the dashboard
            app = PdctlApp(None, refresh=refresh, fleet=fleet)
        else:
            from appliance.collector import Collector
            from appliance.plan.installed import load_plan
            plan = load_plan(args.config)
            slo = V.settings_value(args.config, "workload", "ttft_slo_s")
            tpot_ms = V.settings_value(args.config, "workload", "tpot_slo_ms")
            collector = Collector(plan, interval=refresh, slo_ttft_s=slo,
                                  slo_tpot_s=tpot_ms / 1000.0 if tpot_ms else None).start()
            app = PdctlApp(collector, refresh=refresh, instances=[w.instance for w in plan.workers], fleet=fleet)
        if args.screenshot:
            return screenshot(app, args.screenshot, args.size, args.after)
        app.run()
    finally:
        if collector is not None:
            collector.stop()
        if fleet is not None:
            fleet.stop()
    return EXIT_OK


def _size(value: str) -> tuple:
    try:
        w, h = (int(x) for x in value.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected COLUMNSxROWS, e.g. 160x48") from None
    if not (20 <= w <= 500 and 10 <= h <= 300):
        raise argparse.ArgumentTypeError(f"{value!r}: size out of range (20..500 x 10..300)")
    return w, h


def screenshot(app: Any, path: Path, size: tuple, after: float) -> int:
    """Run the app headless for ``after`` seconds of live data, then save an SVG of the screen."""
    import asyncio

    async def shoot() -> None:
        async with app.run_test(size=size) as pilot:
            await pilot.pause(after)
            app.save_screenshot(filename=path.name, path=str(path.parent.resolve()))
    asyncio.run(shoot())
    print(f"wrote {path}")
    return EXIT_OK


def demo_app(stack, refresh: float):
    """The operator's TUI wired to a demo stack: twin GPU samples, no systemd, logs from the child logs."""
    from appliance.collector import Collector
    from appliance.collector.gpus import twin_sampler
    from appliance.collector.units import NoUnits
    from appliance.inventory import detect
    from appliance.views.actions import ActionResult
    PdctlApp = _app_class()
    plan = stack.plan
    sampler = twin_sampler(state_dir=stack.workdir / "run" / "twin", inventory=detect(plan.inventory_source))
    collector = Collector(plan, gpu_sampler=sampler, interval=refresh,
                          units=NoUnits("not a systemd host (pdctl demo runs child processes)"),
                          slo_ttft_s=2.0, slo_tpot_s=0.08).start()

    def action(verb: str, unit: str) -> ActionResult:
        return ActionResult(False, (), f"{verb} {unit}: not available in pdctl demo (no systemd); "
                                       "install with ./install.sh --simulate to manage units")

    def logs(unit: str, cursor: str) -> tuple:
        name = next((w.instance for w in plan.workers if w.unit == unit),
                    "proxy" if "proxy" in unit else "kvserver")
        lines = stack.tail(name, 200).splitlines()
        seen = int(cursor or 0)
        return lines[seen:] if len(lines) >= seen else lines, str(len(lines)), ""

    app = PdctlApp(collector, refresh=refresh, instances=[w.instance for w in plan.workers], action=action,
                   logs=logs)
    return app, collector


def run_demo_tui(stack, refresh: float) -> int:
    app, collector = demo_app(stack, refresh)
    try:
        app.run()
    finally:
        collector.stop()
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tui", help="live dashboard (Textual); works at 80x24 over SSH")
    p.add_argument("--refresh", type=float, default=None, help="seconds between refreshes (default: config, 1)")
    p.add_argument("--config", type=Path, default=C.CONFIG_PATH, help="pdctl.toml or plan.json")
    p.add_argument("--screenshot", type=Path, metavar="FILE.svg",
                   help="headless: run for --after seconds on live data, save the screen as SVG, exit")
    p.add_argument("--size", type=_size, default=(160, 48), help="screenshot size COLUMNSxROWS (default 160x48)")
    p.add_argument("--after", type=float, default=5.0, help="seconds of live data before the screenshot")
    p.set_defaults(func=cmd_tui)
    demo = sub.choices.get("demo")
    if demo is not None:
        demo.set_defaults(run_ui=run_demo_tui)
