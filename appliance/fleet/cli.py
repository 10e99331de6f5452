"""``pdctl fleet plan|install|status|run`` and ``pdctl export llm-d``."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import constants as C
from ..errors import EXIT_BAD, EXIT_FAIL, EXIT_OK
from ..settings.schema import default as _d
from .plan import DEFAULT_POLICY, POLICIES, FleetError, make_fleet_plan


def _fleet_from_args(args: argparse.Namespace):
    from .install import load_fleet
    if getattr(args, "node", None):
        return make_fleet_plan(args.node, policy=args.policy, listen=args.listen, metrics=args.metrics)
    return load_fleet(Path(args.fleet))


def _print_plan(fleet) -> None:
    r = fleet.router
    print(f"fleet: {len(fleet.nodes)} box(es) behind vllm-router {r.version} on {r.host}:{r.port} "
          f"(policy {r.policy}; metrics {r.metrics_host}:{r.metrics_port})")
    for n in fleet.nodes:
        print(f"  {n.label:<24} {n.url}")
    print("  router: vllm-router " + " ".join(r.argv))
    print("why:")
    for x in fleet.reasons:
        print(f"  - {x}")


def cmd_plan(args: argparse.Namespace) -> int:
    fleet = make_fleet_plan(args.node, policy=args.policy, listen=args.listen, metrics=args.metrics)
    text = json.dumps(fleet.to_json(), indent=2, sort_keys=True) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        sys.stdout.write(text)
    else:
        _print_plan(fleet)
        if args.out:
            print(f"written to {args.out}")
    return EXIT_OK


def cmd_install(args: argparse.Namespace) -> int:
    from .install import run_install
    fleet = _fleet_from_args(args)
    _print_plan(fleet)
    return run_install(args, fleet)


def cmd_status(args: argparse.Namespace) -> int:
    from .status import collect, render_text
    fleet = _fleet_from_args(args)
    key = None
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as exc:
            raise FleetError(f"--api-key-file {args.api_key_file}: {exc.strerror}") from None
    tls = None
    if args.ca_file:
        from ..wire.fetch import client_context
        try:
            tls = client_context(args.ca_file)
        except (OSError, ValueError) as exc:
            raise FleetError(f"--ca-file {args.ca_file}: cannot load it as PEM CA certificates ({exc}); give the "
                             "CA that signed the boxes' certificates") from None
    view = collect(fleet, api_key=key, timeout=args.timeout, tls=tls)
    sys.stdout.write(json.dumps(view.to_json(), indent=2) + "\n" if args.json else render_text(view))
    healthy = view.router.startswith("ok") and all(b.ready == "ready" for b in view.boxes)
    return EXIT_OK if healthy else EXIT_FAIL


def cmd_run(args: argparse.Namespace) -> int:
    from .install import exec_router, load_fleet
    return exec_router(load_fleet(Path(args.fleet)), args.router_bin)


def cmd_export_llmd(args: argparse.Namespace) -> int:
    from .export_llmd import ExportOptions, build, load_plan, validate, values_as_pods, write
    plan = load_plan(Path(args.plan))
    opt = ExportOptions(namespace=args.namespace, name=args.name or "", boxes=args.boxes, image=args.image)
    built = build(plan, opt)
    docs = built["lmcache-node.yaml"] + built["pd-deployments.yaml"] + \
        values_as_pods(built["values-modelservice.yaml"], opt.namespace)
    try:
        import kubernetes_validate as kv
        ver = args.k8s_version or kv.latest_version()
    except ImportError:
        ver = args.k8s_version or "unknown"
    errs = validate(docs, ver)
    for p in write(Path(args.out), built, ver):
        print(f"wrote {p}")
    for r in built["reasons"]:
        print(f"  - {r}")
    if errs and errs[0].startswith("kubernetes-validate is not installed"):
        print(f"[WARN] {errs[0]}", file=sys.stderr)
        return EXIT_OK
    if errs:
        for e in errs:
            print(f"[ERROR] schema: {e}", file=sys.stderr)
        return EXIT_FAIL
    print(f"validated {len(docs)} objects against the strict Kubernetes {ver} schemas (kubernetes-validate)")
    return EXIT_OK


def cmd_whatif(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from .whatif import fleet_whatif, render_markdown

    def ints(text: str, what: str) -> list:
        try:
            return [float(x) if what == "rates" else int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise FleetError(f"--{what} {text!r}: give comma-separated numbers, e.g. 1,2,4") from None
    rows = fleet_whatif(ints(args.boxes, "boxes"), ints(args.rates, "rates"), prefill=args.prefill,
                        decode=args.decode, hardware=args.hardware, model=args.model, num_prompts=args.num_prompts)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        sys.stdout.write(render_markdown(rows, args.slo))
    return EXIT_OK


def _wrap(fn):
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except FleetError as exc:
            print(f"pdctl {args.verb}: error: {exc}", file=sys.stderr)
            return EXIT_BAD
        except OSError as exc:
            where = exc.filename or ""
            print(f"pdctl {args.verb}: error: {where}: {exc.strerror or exc} (check the path and permissions)",
                  file=sys.stderr)
            return EXIT_FAIL
    return run


def _node_flags(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--node", action="append", required=required, metavar="[NAME=][https://]HOST[:PORT]",
                   help=f"a pdctl box's proxy (port {C.PROXY_PORT} by default; https:// for a box with TLS on, "
                        "whose certificate the router and `pdctl fleet status` check); repeat per box")
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=POLICIES,
                   help="vllm-router policy (default %(default)s: prefixes stay on the box that cached them)")
    p.add_argument("--listen", default=f"0.0.0.0:{C.ROUTER_PORT}", help="router address (default %(default)s)")
    p.add_argument("--metrics", default=f"127.0.0.1:{C.ROUTER_METRICS_PORT}",
                   help="router Prometheus address (default %(default)s)")


def register(subparsers) -> None:
    fleet = subparsers.add_parser("fleet", help="several boxes behind vllm-router (plan, install, status)")
    fsub = fleet.add_subparsers(dest="fleet_verb", required=True, metavar="ACTION")

    p = fsub.add_parser("plan", help="the router command for a list of boxes, with the reasons")
    _node_flags(p, required=True)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", help="also write the fleet plan (JSON) to this file")
    p.set_defaults(func=_wrap(cmd_plan))

    p = fsub.add_parser("install", help="on the front node: pinned vllm-router, pd-router.service, start it")
    _node_flags(p, required=False)
    p.add_argument("--fleet", default=str(C.FLEET_PLAN), help="fleet plan file when no --node is given")
    p.add_argument("--venv", help=f"pdctl's virtual environment (default {C.VENV_DIR})")
    p.add_argument("--root", type=Path, default=Path("/"), help="write the files under this directory")
    p.add_argument("--dry-run", action="store_true", help="print (or render under --root) and touch nothing else")
    p.add_argument("--no-start", action="store_true")
    p.add_argument("--ready-timeout", type=float, default=60.0)
    p.set_defaults(func=_wrap(cmd_install))

    p = fsub.add_parser("status", help="every box (health, ready, status endpoint) and the router's view")
    _node_flags(p, required=False)
    p.add_argument("--fleet", default=str(C.FLEET_PLAN))
    p.add_argument("--api-key-file", help="file with the boxes' API key (for their /pdctl/status)")
    p.add_argument("--ca-file", help="PEM CA that signed the https boxes' certificates (default: the system's CAs)")
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_wrap(cmd_status))

    p = fsub.add_parser("run", help="exec vllm-router from a fleet plan (pd-router.service's ExecStart)")
    p.add_argument("--fleet", default=str(C.FLEET_PLAN))
    p.add_argument("--router-bin", type=Path, help="vllm-router executable (default: next to this Python)")
    p.set_defaults(func=_wrap(cmd_run))

    p = fsub.add_parser("whatif", help="twin what-if: N boxes of one plan shape at fleet request rates")
    p.add_argument("--boxes", default="1,2,4")
    p.add_argument("--rates", default="5,10,20,30,40", help="fleet requests/s (default %(default)s)")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--hardware", default="a100-80gb")
    p.add_argument("--model", default=_d("install", "model"))
    p.add_argument("--num-prompts", dest="num_prompts", type=int, default=600,
                   help="prompts per box and rate (default %(default)s, as the seed's benchmark)")
    p.add_argument("--slo", type=float, default=2.0, help="TTFT p95 target in seconds for the summary")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_wrap(cmd_whatif))


def register_export_llmd(esub) -> None:
    """``pdctl export llm-d`` (the export verb itself: views/export.py)."""
    p = esub.add_parser("llm-d", help="Kubernetes manifests + llm-d-modelservice values from a plan, validated")
    p.add_argument("--plan", required=True,
                   help="plan JSON (`pdctl plan --engine vllm --json`, or /etc/pdctl/plan.json)")
    p.add_argument("--out", required=True, help="directory to write into")
    p.add_argument("--namespace", default="default")
    p.add_argument("--name", help="object name prefix (default: the served model name)")
    p.add_argument("--boxes", type=int, default=1, help="nodes, each running one box's prefill + decode pods")
    p.add_argument("--image", default="lmcache/vllm-openai:latest",
                   help="image with vllm and lmcache (default %(default)s; pin a tag in production)")
    p.add_argument("--k8s-version", help="Kubernetes schema version to validate against (default: newest shipped)")
    p.set_defaults(func=_wrap(cmd_export_llmd))
