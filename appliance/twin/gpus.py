"""Twin GPU samples: per-GPU utilization, memory, temperature, power and processes, NVML-shaped.

Each twin engine started with ``--state-file PATH`` (or ``--gpu-index N``, then
``constants.TWIN_STATE_DIR/gpu-N.json``) rewrites a small JSON file every ``STATE_INTERVAL_S``:

    {"index": 0, "name": "NVIDIA H200", "util_pct": 37.5, "mem_used_bytes": ..., "mem_total_bytes": ...,
     "temp_c": 48.2, "power_w": 310.0, "power_limit_w": 700.0,
     "processes": [{"pid": 1234, "name": "pdctl twin engine (decode)", "used_bytes": ...}],
     "updated_at": <unix s>, "source": "twin:<file>"}

- util_pct: share of wall time the engine spent in (simulated) steps over the last interval;
- mem_used_bytes: what vLLM would hold: gpu_memory_utilization x total (it preallocates weights + KV);
- power_w: idle + (TDP - idle) x util; temp_c: first-order approach to 30 + 50 x util C (tau 20 s).

``read_samples`` (and ``sample()``, what the collector's twin sampler calls) reads those files from any
process; GPUs of the twin inventory without a fresh file come back idle (no process, 0 %, ambient).
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional

from appliance import constants as C

STATE_INTERVAL_S = 0.5
STALE_S = 5.0          # a file older than this is an engine that stopped: the GPU reads idle
AMBIENT_C = 30.0
TEMP_SPAN_C = 50.0
TEMP_TAU_S = 20.0


@dataclass(frozen=True)
class GpuSample:
    index: int
    name: str
    util_pct: float
    mem_used_bytes: int
    mem_total_bytes: int
    temp_c: float
    power_w: float
    power_limit_w: float
    processes: tuple       # ({"pid": int, "name": str, "used_bytes": int}, ...)
    updated_at: float      # unix seconds
    source: str            # "twin:<state file>" or "twin:idle"

    def to_json(self) -> dict:
        d = asdict(self)
        d["processes"] = [dict(p) for p in self.processes]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "GpuSample":
        return cls(index=int(d["index"]), name=str(d["name"]), util_pct=float(d["util_pct"]),
                   mem_used_bytes=int(d["mem_used_bytes"]), mem_total_bytes=int(d["mem_total_bytes"]),
                   temp_c=float(d["temp_c"]), power_w=float(d["power_w"]),
                   power_limit_w=float(d.get("power_limit_w", 0.0)),
                   processes=tuple({"pid": int(p["pid"]), "name": str(p.get("name", "")),
                                    "used_bytes": int(p.get("used_bytes", 0))} for p in d.get("processes", [])),
                   updated_at=float(d["updated_at"]), source=str(d.get("source", "twin")))


def next_temp(temp: float, util: float, dt: float) -> float:
    target = AMBIENT_C + TEMP_SPAN_C * util
    return target + (temp - target) * math.exp(-dt / TEMP_TAU_S)


def default_state_file(gpu_index: int) -> Path:
    return C.TWIN_STATE_DIR / f"gpu-{gpu_index}.json"


def write_state(path: Path, sample: GpuSample) -> None:
    """Atomic write (tmp + rename) so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(sample.to_json()))
    os.replace(tmp, path)


def idle_sample(index: int, name: str, mem_total: int, idle_w: float = 0.0, limit_w: float = 0.0) -> GpuSample:
    return GpuSample(index=index, name=name, util_pct=0.0, mem_used_bytes=0, mem_total_bytes=mem_total,
                     temp_c=AMBIENT_C, power_w=idle_w, power_limit_w=limit_w, processes=(),
                     updated_at=time.time(), source="twin:idle")


def _idle_power(name: str) -> tuple[float, float]:
    from .hardware import PROFILES
    for hw in PROFILES.values():
        if hw.nvml_name == name:
            return hw.idle_w, hw.tdp_w
    return 0.0, 0.0


def _state_files(state_dir: Path) -> list[str]:
    """``state_dir/gpu-*.json``, sorted (os.scandir: no pathlib objects on the collector's 1 Hz path)."""
    try:
        with os.scandir(state_dir) as it:
            return sorted(e.path for e in it if e.name.startswith("gpu-") and e.name.endswith(".json"))
    except OSError:
        return []


# path -> ((inode, mtime ns, size), sample): engines rewrite by rename, so an unchanged file is not re-parsed
_PARSED: dict[str, tuple[tuple, GpuSample]] = {}


def _read_state(path: str) -> GpuSample:
    st = os.stat(path)
    key = (st.st_ino, st.st_mtime_ns, st.st_size)
    hit = _PARSED.get(path)
    if hit is not None and hit[0] == key:
        return hit[1]
    with open(path, "rb") as f:
        s = GpuSample.from_json(json.loads(f.read()))
    if len(_PARSED) >= 1024:
        _PARSED.clear()
    _PARSED[path] = (key, s)
    return s


def read_samples(state_dir: Path = C.TWIN_STATE_DIR, inventory=None, files: Optional[Iterable[Path]] = None,
                 stale_s: float = STALE_S) -> list[GpuSample]:
    """Samples for every GPU: from state files (``files`` or ``state_dir/gpu-*.json``), idle otherwise.

    ``inventory`` (an ``appliance.inventory.Inventory``, e.g. ``detect("twin:4xH200")``) fixes the GPU list;
    without it, one sample per readable file. Unreadable or stale files are skipped (the GPU reads idle).
    """
    paths = [str(p) for p in files] if files is not None else _state_files(state_dir)
    now = time.time()
    by_index: dict[int, GpuSample] = {}
    for p in paths:
        try:
            s = _read_state(p)
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            continue
        if now - s.updated_at > stale_s:
            continue
        by_index[s.index] = s
    if inventory is None:
        return [by_index[i] for i in sorted(by_index)]
    out = []
    for g in inventory.gpus:
        if g.index in by_index:
            out.append(by_index[g.index])
        else:
            idle_w, limit_w = _idle_power(g.name)
            out.append(idle_sample(g.index, g.name, g.memory_total_bytes, idle_w, limit_w))
    return out


def sample(state_dir: Path = C.TWIN_STATE_DIR, inventory=None) -> list[GpuSample]:
    """What the collector's twin sampler calls each tick (``appliance.collector.gpus.twin_sampler``)."""
    return read_samples(state_dir, inventory)
