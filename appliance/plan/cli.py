"""``pdctl detect | plan | config``: what the box has, what pdctl would run on it, and the settings behind it.

All three only read (NVML, the settings file, the twin for ``plan --what-if``) and never touch the host.
"""
from __future__ import annotations

import argparse
import json
import sys

from ..errors import EXIT_OK, CliError
from ..settings.cliargs import add_plan_flags, gpus_arg, print_plan, settings_from_args
from ..settings.schema import default


def cmd_detect(args: argparse.Namespace) -> int:
    from ..inventory import detect
    spec, indices = gpus_arg(args.gpus or "nvml")
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


def cmd_plan(args: argparse.Namespace) -> int:
    from .from_settings import plan_from_settings
    if args.list_models:
        from ..model.profiles import REGISTRY
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
        reason, predicted = whatif
        plan = replace(plan, reasons=plan.reasons + (reason,), predicted=predicted)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print_plan(plan)
    return EXIT_OK


def admission_policy(s):
    """The proxy's admission as the settings ask ([admission] and the [workload] SLOs): what-if runs each family
    past its ceiling with it."""
    from dataclasses import fields

    from ..policy.admit import Policy
    a, w = s.values["admission"], s.values["workload"]
    names = {f.name for f in fields(Policy)}
    return Policy(**{k: v for k, v in a.items() if k in names}, ttft_slo_s=w["ttft_slo_s"],
                  tpot_slo_s=w["tpot_slo_ms"] / 1000.0)


def _what_if_split(args: argparse.Namespace, s) -> tuple[str, dict]:
    """Rank every plan family (all-both, hybrids, P/D) on the twin, print the table, and plan the winner:
    (the reason, plan.json's ``"predicted"``). The same ladder, bisection and windows as the planner's own
    ranking (``families``), so both report the same goodput."""
    from ..inventory import detect
    from ..twin.profiles import load_profile
    from ..twin.simulator import Workload as SimWorkload
    from ..twin.whatif import what_if
    from ..twin.whatif_cli import parse_rates, render
    from .families import (PLAN_LIFETIMES, PLAN_REFINE, PLAN_WINDOW_S, RANK_SETUP, plan_workload, predicted_of,
                           workload_shape)
    from .from_settings import WHAT_IF_SOURCE, planner_inputs
    if s.get("plan", "prefill") or s.get("plan", "decode") or s.get("plan", "both"):
        raise CliError("--what-if chooses the plan family itself: drop --prefill/--decode/--both")
    work, ov = planner_inputs(s)
    if args.what_if_profile == "config":
        wl, shape = plan_workload(work), workload_shape(work)
    else:
        prof = load_profile(args.what_if_profile)
        wl = SimWorkload(prof.input_len, prof.prefix_len, prof.output_len)
        shape = f"{prof.prefix_len}+{prof.input_len - prof.prefix_len} in / {prof.output_len} out"
    if args.what_if_num_prompts < 1:
        raise CliError("--sim-prompts must be >= 1")
    slo = args.what_if_slo if args.what_if_slo is not None else work.ttft_slo_s
    w = what_if(detect(s.get("install", "gpus")), s.get("install", "model"), wl, parse_rates(args.what_if_rates),
                slo_ttft_p95_s=slo, policy=s.get("proxy", "policy"), tp=max(1, s.get("plan", "tp")),
                num_prompts=args.what_if_num_prompts, objective=args.what_if_objective, family="all",
                slo_tpot_p95_ms=work.tpot_slo_ms, thresholds=ov.thresholds, min_window_s=PLAN_WINDOW_S,
                refine=PLAN_REFINE, admission=admission_policy(s), peak_rate=work.peak_rate, setup=RANK_SETUP,
                min_lifetimes=PLAN_LIFETIMES)
    print(render(w), file=sys.stderr if args.json else sys.stdout)
    rec = w.recommended
    if rec is None:
        raise CliError("what-if found no family that holds the SLOs on this box; plan without --what-if, lower "
                       "the SLOs ([workload] ttft_slo_s, tpot_slo_ms) or add GPUs")
    v = s.values["plan"]
    v["prefill"], v["decode"], v["both"] = rec.prefill, rec.decode, rec.both
    s.sources["plan.prefill"] = s.sources["plan.decode"] = s.sources["plan.both"] = WHAT_IF_SOURCE
    return (f"{rec.family} chosen by the twin's what-if ({args.what_if_objective}): highest rate with TTFT p95 "
            f"under {slo:g} s and TPOT p95 under {work.tpot_slo_ms:g} ms ({rec.max_rate_under_slo:.3g} req/s, "
            f"delivered ceiling {rec.ceiling:.3g} req/s)"), predicted_of(w, shape)


def cmd_config(args: argparse.Namespace) -> int:
    from ..settings.config import resolve, template
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


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("detect", help="list the GPUs (NVML, fake spec or JSON file)")
    p.add_argument("--gpus", default=default("install", "gpus"), help="nvml | fake:8xH200 | fake:2xA100-80GB+2xH100 | none | FILE.json")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_detect)

    p = sub.add_parser("plan", help="plan roles, GPUs, ports and engine commands (prints the reasons)")
    add_plan_flags(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--what-if", dest="what_if", action="store_true",
                   help="rank every plan family (all-both, hybrids, P/D splits) on the twin, show predicted goodput, "
                        "TTFT and TPOT per rate, "
                        "and plan with the recommended one")
    from ..twin.whatif_cli import add_what_if_flags
    add_what_if_flags(p, prefix="what_if_")
    from .families import PLAN_PROMPTS, PLAN_RATES
    p.set_defaults(what_if_slo=None, what_if_rates=",".join(map(str, PLAN_RATES)), what_if_profile="config",
                   what_if_num_prompts=PLAN_PROMPTS)   # the plan's own SLOs, workload ([workload] keys) and
    #                                                    the ranking's ladder and windows unless given
    p.add_argument("--list-models", action="store_true", help="list the model registry")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("config", help="show settings with their sources, or print the documented template")
    p.add_argument("action", choices=("show", "template"))
    add_plan_flags(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_config)
