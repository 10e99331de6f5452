"""``pdctl``: one verb per job. Exit codes (errors.py): 0 ok, 1 failure, 2 bad input (with what, where, how to fix).

Every verb group is a module with ``register(subparsers)``; this file only walks them, then the groups other
packages declare in the ``pdctl.verbs`` entry point group (the UI's, tui/cli.py: the core never imports tui).
"""
from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

from . import __version__
from .bench import cli as bench_cli
from .doctor import cli as doctor_cli
from .errors import EXIT_BAD, EXIT_FAIL, CliError
from .fleet import cli as fleet_cli
from .install import cli as install
from .keys import cli as keys_cli
from .launcher import cli as launcher_cli
from .model import cli as model_cli
from .plan import cli as plan_cli
from .proxy import cli as proxy_cli
from .stack import demo
from .twin import cli as twin_cli
from .views import cli as views_cli
from .views import export as export_cli

# in the order of `pdctl --help`; demo before the entry points (the UI adds the demo's dashboard to it)
VERB_GROUPS = (plan_cli, install, twin_cli, proxy_cli, views_cli, launcher_cli, demo, bench_cli, fleet_cli, export_cli,
               model_cli, doctor_cli, keys_cli)
ENTRY_POINT_GROUP = "pdctl.verbs"
# verbs the UI package is expected to add: without it they say why instead of argparse's "invalid choice"
UI_VERBS = {"tui": "live dashboard (Textual); works at 80x24 over SSH"}


def _unavailable(verb: str, why: str):
    def cmd(args: argparse.Namespace) -> int:
        raise CliError(f"`pdctl {verb}` is not available: {why}", EXIT_FAIL)
    return cmd


def _add_unavailable(sub: argparse._SubParsersAction, verb: str, help_text: str, why: str) -> None:
    # no option prefix: whatever follows (--help included) is taken as is and the verb explains itself
    p = sub.add_parser(verb, help=f"{help_text} [not available: {why}]", prefix_chars="\0", add_help=False)
    p.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    p.set_defaults(func=_unavailable(verb, why))


def register_entry_points(sub: argparse._SubParsersAction) -> None:
    """The verb groups of other installed packages; one that fails to load becomes a verb that says why."""
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()(sub)
        except Exception as exc:  # noqa: BLE001 - a broken add-on must not take the core's verbs down with it
            if ep.name not in sub.choices:
                _add_unavailable(sub, ep.name, UI_VERBS.get(ep.name, ep.value),
                                 f"{ep.value} did not load ({type(exc).__name__}: {exc})")
    for verb, help_text in UI_VERBS.items():
        if verb not in sub.choices:
            _add_unavailable(sub, verb, help_text, "the tui package is not installed (or its entry point is not "
                             "registered: reinstall pdctl, `pip install -e .` in a checkout)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdctl", description="prefill/decode-disaggregated LLM appliance")
    ap.add_argument("--version", action="version", version=f"pdctl {__version__}")
    sub = ap.add_subparsers(dest="verb", required=True, metavar="VERB")
    for group in VERB_GROUPS:
        group.register(sub)
    register_entry_points(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    from .bench import BenchError
    from .inventory import InventoryError
    from .model.profiles import ModelError
    from .plan.planner import PlanError
    from .settings.config import ConfigError
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
    except (ConfigError, PlanError, ModelError, CliError, BenchError) as exc:
        print(f"pdctl {args.verb}: error: {exc}", file=sys.stderr)
        return getattr(exc, "code", EXIT_BAD)
    except InventoryError as exc:
        print(f"pdctl {args.verb}: error: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
