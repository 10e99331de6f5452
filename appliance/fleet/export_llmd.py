"""``pdctl export llm-d --plan FILE --out DIR``: the same Plan as Kubernetes objects for llm-d's P/D layout.

What carries over from one box to a cluster: roles (pod label ``llm-d.ai/role``), TP (GPUs per pod and
``--tensor-parallel-size``), the vLLM arguments (the planner's, with host/port/KV-server address made
pod-relative), and the LMCache MP server, which must stay on the node of its GPUs (CUDA IPC): one per
node as a DaemonSet, reached through a Service with ``internalTrafficPolicy: Local`` so a pod only ever
talks to the server on its own node. Pure: Plan in, documents out; the CLI writes them.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .. import constants as C
from .. import yamlout
from ..plan.types import Plan
from .plan import FleetError

VLLM_PORT = 8000            # the port llm-d's InferencePool and sidecar expect on a pod (routing.servicePort)
SIDECAR_TARGET_PORT = 8200  # decode pods behind llm-d's routing sidecar listen here (routing.proxy.targetPort)
NODE_LABEL = "pdctl.io/lmcache-node"
DROP_ENV = {"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", C.ENV_TELEMETRY_TYPE,
            C.ENV_TELEMETRY_ENDPOINT}   # the device plugin picks GPUs; telemetry feeds pdctl's proxy only
DEFAULT_IMAGE = "lmcache/vllm-openai:latest"


@dataclass(frozen=True)
class ExportOptions:
    namespace: str = "default"
    name: str = ""               # object name prefix; default from the served model name
    boxes: int = 1               # nodes that each run one box's worth of prefill + decode pods
    image: str = DEFAULT_IMAGE   # needs vllm and lmcache (the connector and the MP server)
    lmcache_image: str = ""      # default: the same image


def dns_name(text: str) -> str:
    s = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return (s[:40].rstrip("-") or "model")


def load_plan(path: Path) -> Plan:
    try:
        d = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FleetError(f"--plan {path}: no such file; write one with `pdctl plan --engine vllm --json > {path}` "
                         "(or use /etc/pdctl/plan.json of an installed box)") from None
    except (OSError, ValueError) as exc:
        raise FleetError(f"--plan {path}: not readable JSON ({exc})") from None
    try:
        return Plan.from_json(d)
    except (KeyError, TypeError, ValueError) as exc:
        raise FleetError(f"--plan {path}: not a pdctl plan (missing or bad {exc}); write one with "
                         "`pdctl plan --engine vllm --json`") from None


def _flag(argv: list, name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _set_flag(argv: list, name: str, value: str) -> list:
    out, i, done = [], 0, False
    while i < len(argv):
        a = argv[i]
        if a == name and i + 1 < len(argv):
            out += [name, value]
            i += 2
            done = True
            continue
        if a.startswith(name + "="):
            out.append(f"{name}={value}")
            done = True
        else:
            out.append(a)
        i += 1
    return out if done else out + [name, value]


def vllm_args(worker, lmcache_host: str, port: int) -> list:
    """The planner's engine argv as container args (after ``vllm serve``), made pod-relative."""
    argv = list(worker.argv)
    if len(argv) < 3 or argv[1] != "serve" or not argv[0].endswith("vllm"):
        raise FleetError(f"worker {worker.instance}: argv does not start with `vllm serve MODEL` "
                         f"({' '.join(argv[:3])}); export needs a plan made with --engine vllm")
    args = argv[2:]
    args = _set_flag(args, "--host", "0.0.0.0")
    args = _set_flag(args, "--port", str(port))
    kv = _flag(args, "--kv-transfer-config")
    if kv:
        try:
            cfg = json.loads(kv)
        except ValueError:
            raise FleetError(f"worker {worker.instance}: --kv-transfer-config is not JSON") from None
        extra = dict(cfg.get("kv_connector_extra_config") or {})
        if "lmcache.mp.host" in extra:
            extra["lmcache.mp.host"] = f"tcp://{lmcache_host}"
        cfg["kv_connector_extra_config"] = extra
        args = _set_flag(args, "--kv-transfer-config", json.dumps(cfg, separators=(",", ":"), sort_keys=True))
    return args


def _env(worker) -> list:
    return [{"name": k, "value": str(v)} for k, v in sorted(worker.env.items()) if k not in DROP_ENV]


def _labels(base: str, model: str, role: str | None = None) -> dict:
    out = {"app.kubernetes.io/name": base, "app.kubernetes.io/managed-by": "pdctl",
           "llm-d.ai/inferenceServing": "true", "llm-d.ai/model": model}
    if role:
        out["llm-d.ai/role"] = role
    return out


def _container(name: str, image: str, args: list, env: list, port: int, gpus: int) -> dict:
    return {
        "name": name, "image": image, "command": ["vllm", "serve"], "args": args, "env": env,
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}, "requests": {"nvidia.com/gpu": str(gpus)}},
        "readinessProbe": {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 5, "timeoutSeconds": 2,
                           "failureThreshold": 3},
        "startupProbe": {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 10, "timeoutSeconds": 2,
                         "failureThreshold": 90},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }


def build(plan: Plan, opt: ExportOptions) -> dict:
    """``{file name: list of documents}`` plus the values file for llm-d-modelservice and the reasons."""
    if plan.engine != "vllm" or plan.kv_server.kind != "lmcache":
        raise FleetError(f"the plan runs engine {plan.engine!r} with KV server {plan.kv_server.kind!r}; llm-d runs "
                         "vLLM with the real LMCache server: re-plan with `pdctl plan --engine vllm --json`")
    if opt.boxes < 1:
        raise FleetError(f"--boxes {opt.boxes}: must be >= 1 (nodes that each run one box's pods)")
    ns = opt.namespace
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", ns):
        raise FleetError(f"--namespace {ns!r} is not a Kubernetes namespace name (lower-case letters, digits, '-')")
    base = dns_name(opt.name or plan.served_model_name)
    model = dns_name(plan.served_model_name)
    image = opt.image
    kv = plan.kv_server
    lmc_name = f"{base}-lmcache"
    lmc_host = f"{lmc_name}.{ns}.svc.cluster.local"
    kv_args = list(kv.argv[1:]) if kv.argv and Path(kv.argv[0]).name == "lmcache" else list(kv.argv)
    # the server listens on the pod network of its node; the Service keeps every client node-local
    kv_args = _set_flag(_set_flag(kv_args, "--host", "0.0.0.0"), "--http-host", "0.0.0.0")
    lmc_labels = {"app.kubernetes.io/name": lmc_name, "app.kubernetes.io/managed-by": "pdctl"}
    daemonset = {
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": lmc_name, "namespace": ns, "labels": lmc_labels},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": lmc_name}},
            "template": {
                "metadata": {"labels": lmc_labels},
                "spec": {
                    "nodeSelector": {NODE_LABEL: "true"},
                    "hostIPC": True,     # CUDA IPC handles from the vLLM pods on this node
                    "containers": [{
                        "name": "lmcache", "image": opt.lmcache_image or image, "command": ["lmcache"],
                        "args": kv_args,
                        "env": [{"name": k, "value": str(v)} for k, v in sorted(kv.env.items())] +
                               [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
                        "ports": [{"name": "zmq", "containerPort": kv.zmq_port, "protocol": "TCP"},
                                  {"name": "http", "containerPort": kv.http_port, "protocol": "TCP"}],
                        "readinessProbe": {"httpGet": {"path": "/healthcheck", "port": kv.http_port},
                                           "periodSeconds": 5, "timeoutSeconds": 2},
                        "resources": {"requests": {"memory": f"{int(kv.l1_size_gb + 2)}Gi"},
                                      "limits": {"memory": f"{int(kv.l1_size_gb + 4)}Gi"}},
                        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
                    }],
                    "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": lmc_name, "namespace": ns, "labels": lmc_labels},
        "spec": {"selector": {"app.kubernetes.io/name": lmc_name}, "internalTrafficPolicy": "Local",
                 "ports": [{"name": "zmq", "port": kv.zmq_port, "targetPort": kv.zmq_port, "protocol": "TCP"}]},
    }
    deployments, values_roles = [], {}
    for role in ("prefill", "decode"):
        # llm-d has two roles; kv_both workers become decode pods (they keep kv_both, so they still store
        # what they compute; llm-d's own P/D decider then chooses per request what pdctl's proxy chose)
        ws = plan.by_role(role) + (plan.by_role("both") if role == "decode" else [])
        if not ws:
            continue
        w = ws[0]
        tps = {x.tp for x in ws}
        if len(tps) != 1:
            raise FleetError(f"the plan gives {role} workers different TP sizes {sorted(tps)}; one Deployment needs "
                             "one TP: re-plan with --tp N")
        port = VLLM_PORT
        args = vllm_args(w, lmc_host, port)
        labels = _labels(f"{base}-{role}", model, role)
        pod_spec = {
            "nodeSelector": {NODE_LABEL: "true"},
            "hostIPC": True,
            "containers": [_container("vllm", image, args, _env(w), port, w.tp)],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
            "terminationGracePeriodSeconds": 60,
        }
        if role == "decode" and plan.by_role("prefill"):
            pod_spec["affinity"] = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
                "labelSelector": {"matchLabels": {"llm-d.ai/role": "prefill", "llm-d.ai/model": model}},
                "topologyKey": "kubernetes.io/hostname"}]}}
        deployments.append({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": f"{base}-{role}", "namespace": ns, "labels": labels},
            "spec": {"replicas": len(ws) * opt.boxes, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": pod_spec}},
        })
        vport = SIDECAR_TARGET_PORT if role == "decode" else VLLM_PORT
        c = _container("vllm", image, vllm_args(w, lmc_host, vport), _env(w), vport, w.tp)
        c.pop("readinessProbe")
        c.pop("startupProbe")
        c["modelCommand"] = "custom"
        c["mountModelVolume"] = False
        values_roles[role] = {"create": True, "replicas": len(ws) * opt.boxes, "nodeSelector": {NODE_LABEL: "true"},
                              "parallelism": {"tensor": w.tp}, "containers": [c],
                              "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]}
    if "prefill" not in values_roles:
        values_roles["prefill"] = {"create": False, "replicas": 0}
    values = {
        "modelArtifacts": {"name": plan.served_model_name, "uri": f"hf://{plan.model}",
                           "labels": {"llm-d.ai/inferenceServing": "true", "llm-d.ai/model": model}},
        "routing": {"servicePort": VLLM_PORT,
                    "proxy": {"enabled": bool(plan.by_role("prefill")), "targetPort": SIDECAR_TARGET_PORT}},
        **values_roles,
    }
    reasons = [
        f"{len(plan.by_role('prefill'))} prefill + {len(plan.by_role('decode')) + len(plan.by_role('both'))} decode "
        f"pods per node x {opt.boxes} "
        f"node(s), TP {plan.tp}, from the plan for {plan.hardware or 'this box'}",
        f"one LMCache MP server per node (DaemonSet {lmc_name}, L1 {kv.l1_size_gb:g} GiB); pods reach it through "
        f"Service {lmc_name} with internalTrafficPolicy Local: the KV L1 never crosses nodes (CUDA IPC)",
        "decode pods require a prefill pod on their node (podAffinity), so a node never has decoders without a "
        "prefiller sharing its L1",
        f"nodes must carry the label {NODE_LABEL}=true (kubectl label node NODE {NODE_LABEL}=true)",
        f"hostIPC (CUDA IPC between the vLLM pods and the node's LMCache server) needs namespace {ns} at Pod "
        "Security level 'privileged'; the LMCache pod sees the node's GPUs through NVIDIA_VISIBLE_DEVICES=all",
    ]
    if plan.by_role("both"):
        reasons.append(f"{len(plan.by_role('both'))} kv_both worker(s) exported as decode pods: llm-d has no soft "
                       "roles; they keep kv_role kv_both, so what they compute stays loadable by every pod")
    return {"lmcache-node.yaml": [daemonset, service], "pd-deployments.yaml": deployments,
            "values-modelservice.yaml": values, "reasons": reasons}


def values_as_pods(values: dict, namespace: str = "default") -> list:
    """Each role of the Helm values as a Pod, so its Kubernetes-typed fields can be schema-checked."""
    pods = []
    for role in ("prefill", "decode"):
        r = values.get(role) or {}
        if not r.get("create", True) or not r.get("containers"):
            continue
        cs = [{k: v for k, v in c.items() if k not in ("modelCommand", "mountModelVolume")} for c in r["containers"]]
        pods.append({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"values-{role}", "namespace": namespace},
                     "spec": {"containers": cs, "volumes": r.get("volumes", []),
                              "nodeSelector": r.get("nodeSelector", {})}})
    return pods


def validate(docs: list, k8s_version: str | None = None) -> list:
    """Schema errors (empty = valid) against kubernetes-validate's strict published schemas."""
    try:
        import kubernetes_validate as kv
    except ImportError:
        return ["kubernetes-validate is not installed (pip install kubernetes-validate): not validated"]
    ver = k8s_version or kv.latest_version()
    errs = []
    for d in docs:
        try:
            kv.validate(d, ver, strict=True)
        except kv.ValidationError as exc:
            errs.append(f"{d.get('kind')}/{d.get('metadata', {}).get('name')}: {exc.message} at "
                        f"{'/'.join(map(str, exc.path))}")
        except (kv.SchemaNotFoundError, kv.InvalidSchemaError) as exc:
            errs.append(f"{d.get('kind')}: no schema ({exc})")
    return errs


README = """# llm-d export of a pdctl plan

Generated by `pdctl export llm-d`. Files:

- `lmcache-node.yaml`: one LMCache MP server per labelled node (DaemonSet) and a node-local Service.
- `pd-deployments.yaml`: prefill and decode Deployments (plain Kubernetes, llm-d role labels).
- `values-modelservice.yaml`: the same pods as values for llm-d's `llm-d-modelservice` Helm chart (use this
  *or* `pd-deployments.yaml`, not both; apply `lmcache-node.yaml` in either case).

Why:
{reasons}

Validated offline: every object in the two manifest files, and every container of the values file (as a Pod),
against the strict Kubernetes {k8s} schemas shipped by the `kubernetes-validate` package.
Not validated or exercised: the Helm chart's own `values.schema.json` (not shipped in any PyPI/npm package), a
real cluster, llm-d's InferencePool / EPP / HTTPRoute (installed by llm-d's charts), the image tag, and
whether llm-d's routing sidecar drives an LMCache-MP P leg the same way pdctl's proxy does.
"""


def write(out: Path, built: dict, k8s_version: str) -> list:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in ("lmcache-node.yaml", "pd-deployments.yaml"):
        (out / name).write_text(yamlout.dump_all(built[name]))
        written.append(out / name)
    head = "# values for llm-d-modelservice (generated by pdctl export llm-d)\n"
    (out / "values-modelservice.yaml").write_text(head + yamlout.dump(built["values-modelservice.yaml"]))
    written.append(out / "values-modelservice.yaml")
    reasons = "\n".join(f"- {r}" for r in built["reasons"])
    (out / "README.md").write_text(README.format(reasons=reasons, k8s=k8s_version))
    written.append(out / "README.md")
    return written
