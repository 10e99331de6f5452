"""``pdctl``: one verb per job. Exit codes: 0 ok, 1 failure, 2 bad input (with what, where, how to fix)."""
from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from pathlib import Path

from . import __version__
from . import constants as C

EXIT_OK, EXIT_FAIL, EXIT_BAD = 0, 1, 2

# feature modules that add their own verbs: each exposes register(subparsers)
FEATURE_MODULES = (
    "appliance.twin.cli",
    "appliance.proxy.cli",
    "appliance.collector.cli",
    "appliance.launcher.cli",
    "appliance.demo",
    "appliance.bench.cli",
    "appliance.fleet.cli",
)


class CliError(Exception):
    def __init__(self, msg: str, code: int = EXIT_BAD):
        super().__init__(msg)
        self.code = code


def _gpus_arg(value: str) -> tuple[str, tuple]:
    """``--gpus`` is an inventory spec (nvml, fake:4xH200, FILE) or GPU indices of the real box (0,1,2)."""
    if re.fullmatch(r"\d+(,\d+)*", value.strip()):
        return "nvml", tuple(int(x) for x in value.split(","))
    return value, ()


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=C.CONFIG_PATH, help="settings file (default %(default)s)")
    p.add_argument("--gpus", help="inventory spec: nvml | fake:8xH200 | twin:4xH200 | none | FILE.json, "
                                  "or GPU indices of this box: 0,1,2")
    p.add_argument("--model", help="registry name or model directory")
    p.add_argument("--engine", choices=("vllm", "vllm-cpu", "twin"))
    p.add_argument("--engine-version", dest="engine_version")
    p.add_argument("--prefill", type=int, help="dedicated prefill workers (all three counts 0: the twin ranks families)")
    p.add_argument("--decode", type=int, help="dedicated decode workers")
    p.add_argument("--both", type=int, help="kv_both workers (soft roles: the proxy decides per request)")
    p.add_argument("--tp", type=int)
    p.add_argument("--policy", choices=("adaptive", "pdctl", "round-robin"))
    p.add_argument("--l1-size-gb", dest="l1_size_gb", type=float)
    p.add_argument("--max-model-len", dest="max_model_len", type=int)
    p.add_argument("--served-model-name", dest="served_model_name")


def settings_from_args(args: argparse.Namespace, simulate: bool = False):
    from .config import resolve
    flags = {k: getattr(args, k, None) for k in ("model", "engine", "engine_version", "prefill", "decode", "both",
                                                 "tp", "policy", "l1_size_gb", "max_model_len", "served_model_name")}
    indices: tuple = ()
    if getattr(args, "gpus", None):
        flags["gpus"], indices = _gpus_arg(args.gpus)
    if simulate:
        flags["engine"] = "twin"
        if not getattr(args, "gpus", None):
            flags["gpus"] = "twin:4xH200"
    s = resolve(args.config, flags=flags)
    if s.get("install", "engine") == "vllm-cpu" and s.sources.get("install.gpus") == "default":
        s.values["install"]["gpus"] = "none"     # CPU engines need no GPU: never ask NVML for one
        s.sources["install.gpus"] = "engine vllm-cpu"
    if indices:
        s.values["plan"]["gpu_indices"] = list(indices)
        s.sources["plan.gpu_indices"] = "flag"
    if getattr(args, "venv", None):
        for k in ("venv", "engine_venv"):
            s.values["install"][k] = args.venv
            s.sources[f"install.{k}"] = "flag"
    if getattr(args, "engine_venv", None):
        s.values["install"]["engine_venv"] = args.engine_venv
        s.sources["install.engine_venv"] = "flag"
    return s


# --- verbs -----------------------------------------------------------------------------------------
def cmd_detect(args: argparse.Namespace) -> int:
    from .inventory import detect
    spec, indices = _gpus_arg(args.gpus or "nvml")
    inv = detect(spec)
    if args.json:
        print(json.dumps(inv.to_json(), indent=2))
        return EXIT_OK
    print(f"source {inv.source}  driver {inv.driver_version}  CUDA {inv.cuda_version}  "
          f"host RAM {inv.host_ram_bytes / 1024**3:.0f} GiB  CPUs {inv.cpu_count}")
    print(f"{'GPU':>3}  {'name':<24} {'memory':>9}  {'PCI bus':<16} {'NUMA':>4}  {'CC':>4}  {'MIG':<8}  NVLink peers")
    for g in inv.gpus:
        if indices and g.index not in indices:
            continue
        print(f"{g.index:>3}  {g.name:<24} {g.memory_total_bytes / 1024**3:>6.0f} GiB  {str(g.pci_bus_id):<16} "
              f"{str(g.numa_node):>4}  {str(g.compute_capability):>4}  {str(g.mig_mode):<8}  "
              f"{','.join(map(str, g.nvlink_peers)) or '-'}")
    if not inv.gpus:
        print("no GPUs")
    print("NVLink islands:", " ".join("[" + ",".join(map(str, i)) + "]" for i in inv.islands()) or "-")
    return EXIT_OK


def print_plan(plan) -> None:
    print(f"{plan.mode} plan: {plan.model} on {plan.hardware or 'CPU'} ({plan.inventory_source}), engine "
          f"{plan.engine} {plan.engine_version}, TP {plan.tp}")
    print(f"  {'instance':<11} {'role':<8} {'GPUs':<12} {'port':>5}  unit")
    for w in plan.workers:
        gp = ",".join(map(str, w.gpus)) if w.gpus else ("cpu " + ",".join(map(str, w.cpus)))
        print(f"  {w.instance:<11} {w.role:<8} {gp:<12} {w.port:>5}  {w.unit}")
    k = plan.kv_server
    print(f"  KV server   {k.kind}, ZMQ 127.0.0.1:{k.zmq_port}, HTTP 127.0.0.1:{k.http_port}, "
          f"L1 {k.l1_size_gb:g} GiB")
    print(f"  proxy       {plan.proxy.host}:{plan.proxy.port} (policy {plan.proxy.policy}; "
          f"telemetry {plan.proxy.telemetry_url})")
    print("why:")
    for r in plan.reasons:
        print(f"  - {r}")


def cmd_plan(args: argparse.Namespace) -> int:
    from .plan_settings import plan_from_settings
    if args.list_models:
        from .models import REGISTRY
        for m in REGISTRY.values():
            print(f"{m.name:<22} {m.weights_bytes / 1024**3:>7.1f} GiB weights  {m.kv_bytes_per_token:>7,} B/token KV  "
                  f"({m.source})")
        return EXIT_OK
    s = settings_from_args(args)
    whatif = None
    if args.what_if:
        whatif = _what_if_split(args, s)
    plan = plan_from_settings(s)
    if whatif:
        from dataclasses import replace
        plan = replace(plan, reasons=plan.reasons + (whatif,))
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print_plan(plan)
    return EXIT_OK


def _what_if_split(args: argparse.Namespace, s) -> str:
    """Rank every plan family (all-both, hybrids, P/D) on the twin, print the table, and plan the winner."""
    from .bench.cli import parse_rates
    from .bench.whatif import render, what_if
    from .bench.workload import load_profile
    from .inventory import detect
    from .plan_settings import planner_inputs
    from .families import PLAN_WINDOW_S, plan_workload
    from .twin.simulator import Workload as SimWorkload
    if s.get("plan", "prefill") or s.get("plan", "decode") or s.get("plan", "both"):
        raise CliError("--what-if chooses the plan family itself: drop --prefill/--decode/--both")
    work, ov = planner_inputs(s)
    if args.what_if_profile == "config":
        wl = plan_workload(work)
    else:
        prof = load_profile(args.what_if_profile)
        wl = SimWorkload(prof.input_len, prof.prefix_len, prof.output_len)
    slo = args.what_if_slo if args.what_if_slo is not None else work.ttft_slo_s
    w = what_if(detect(s.get("install", "gpus")), s.get("install", "model"), wl, parse_rates(args.what_if_rates),
                slo_ttft_p95_s=slo, policy=s.get("proxy", "policy"), tp=max(1, s.get("plan", "tp")),
                num_prompts=args.what_if_num_prompts, objective=args.what_if_objective, family="all",
                slo_tpot_p95_ms=work.tpot_slo_ms, thresholds=ov.thresholds, min_window_s=PLAN_WINDOW_S)
    print(render(w), file=sys.stderr if args.json else sys.stdout)
    rec = w.recommended
    if rec is None:
        raise CliError("what-if found no family that holds the SLOs on this box; plan without --what-if, lower "
                       "the SLOs ([workload] ttft_slo_s, tpot_slo_ms) or add GPUs")
    v = s.values["plan"]
    v["prefill"], v["decode"], v["both"] = rec.prefill, rec.decode, rec.both
    s.sources["plan.prefill"] = s.sources["plan.decode"] = s.sources["plan.both"] = "what-if"
    return (f"{rec.family} chosen by the twin's what-if ({args.what_if_objective}): highest rate with TTFT p95 "
            f"under {slo:g} s and TPOT p95 under {work.tpot_slo_ms:g} ms ({rec.max_rate_under_slo:.3g} req/s)")


def cmd_config(args: argparse.Namespace) -> int:
    from .config import resolve, template
    if args.action == "template":
        sys.stdout.write(template())
        return EXIT_OK
    s = settings_from_args(args) if args.action == "show" else resolve(args.config)
    if args.json:
        print(json.dumps({f"{sec}.{k}": {"value": v, "source": s.sources[f"{sec}.{k}"]}
                          for sec, body in s.values.items() for k, v in body.items()}, indent=2))
        return EXIT_OK
    for sec, body in s.values.items():
        for k, v in body.items():
            print(f"{sec + '.' + k:<34} {json.dumps(v):<28} {s.sources[f'{sec}.{k}']}")
    return EXIT_OK


def cmd_install(args: argparse.Namespace) -> int:
    from .install import run_install
    return run_install(args)


def cmd_uninstall(args: argparse.Namespace) -> int:
    from .install import run_uninstall
    return run_uninstall(args)


def cmd_apply(args: argparse.Namespace) -> int:
    from .install import run_apply
    return run_apply(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdctl", description="prefill/decode-disaggregated LLM appliance")
    ap.add_argument("--version", action="version", version=f"pdctl {__version__}")
    sub = ap.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser("detect", help="list the GPUs (NVML, fake spec or JSON file)")
    p.add_argument("--gpus", default="nvml", help="nvml | fake:8xH200 | fake:2xA100-80GB+2xH100 | none | FILE.json")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_detect)

    p = sub.add_parser("plan", help="plan roles, GPUs, ports and engine commands (prints the reasons)")
    add_plan_flags(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--what-if", dest="what_if", action="store_true",
                   help="rank every plan family (all-both, hybrids, P/D splits) on the twin, show predicted goodput, "
                        "TTFT and TPOT per rate, "
                        "and plan with the recommended one")
    from .bench.cli import add_what_if_flags
    add_what_if_flags(p, prefix="what_if_")
    p.set_defaults(what_if_slo=None, what_if_rates="1,2,4,8,16,32,64", what_if_profile="config",
                   what_if_num_prompts=300)   # the plan's own SLOs and workload ([workload] keys) unless given
    p.add_argument("--list-models", action="store_true", help="list the model registry")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("config", help="show settings with their sources, or print the documented template")
    p.add_argument("action", choices=("show", "template"))
    add_plan_flags(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("install", help="detect, plan, write config and units, start pd.target")
    add_plan_flags(p)
    p.add_argument("--root", type=Path, default=Path("/"), help="write the tree under this directory")
    p.add_argument("--dry-run", action="store_true", help="render under --root (or print) and touch nothing else")
    p.add_argument("--simulate", action="store_true", help="twin GPUs, twin engines, twin KV server")
    p.add_argument("--no-start", action="store_true")
    p.add_argument("--venv", help="pdctl's virtual environment (default /opt/pdctl)")
    p.add_argument("--engine-venv", dest="engine_venv", help="virtual environment with vllm + lmcache")
    p.add_argument("--ready-timeout", type=float, default=900.0,
                   help="bound on the wait for readiness, seconds (default %(default)s)")
    p.add_argument("--preflight-only", action="store_true", dest="preflight_only",
                   help="run every preflight check, print all refusals, write nothing")
    p.add_argument("--engines-pending", action="store_true", dest="engines_pending",
                   help="the engines are not installed yet (install.sh): check room and paths for them")
    p.set_defaults(func=cmd_install)

    p = sub.add_parser("apply", help="re-plan from the settings file; restart only the units that changed")
    p.add_argument("--config", type=Path, default=C.CONFIG_PATH)
    p.add_argument("--root", type=Path, default=Path("/"))
    p.add_argument("--no-restart", action="store_true")
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser("uninstall", help="stop and remove units, user and files (--purge: also config/state)")
    p.add_argument("--purge", action="store_true")
    p.add_argument("--root", type=Path, default=Path("/"))
    p.set_defaults(func=cmd_uninstall)

    for mod in FEATURE_MODULES:
        try:
            importlib.import_module(mod).register(sub)
        except ModuleNotFoundError as exc:
            if exc.name != mod and not mod.startswith(str(exc.name)):
                raise
    from . import model_cli   # pdctl model fetch|path
    model_cli.register(sub)
    from .doctor import cli as doctor_cli   # pdctl doctor [--json]
    doctor_cli.register(sub)
    from importlib.metadata import entry_points
    for ep in entry_points(group="pdctl.verbs"):   # the UI's verbs (tui/cli.py): the core never imports tui
        ep.load()(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    from .config import ConfigError
    from .inventory import InventoryError
    from .models import ModelError
    from .planner import PlanError
    from .bench import BenchError
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
