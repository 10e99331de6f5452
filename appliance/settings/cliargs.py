"""The plan's command-line flags and what they turn into: settings with sources, and the printed plan.

Why its own module: ``plan``, ``config`` and ``install`` all take these flags; keeping them out of cli.py lets
the verb modules import them without importing the dispatcher that imports them.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from .. import constants as C


def gpus_arg(value: str) -> tuple[str, tuple]:
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
        flags["gpus"], indices = gpus_arg(args.gpus)
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
