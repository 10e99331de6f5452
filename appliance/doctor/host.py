"""The host's own facts for ``pdctl doctor``: CPU affinity of a process, NUMA nodes, a GPU's PCIe link (sysfs).

Read-only and NA on failure, as every probe; apart from probe.py because they read the kernel, not the stack.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union

from appliance.inventory import NA


def cpu_affinity(pid: int) -> Union[tuple, NA]:
    try:
        return tuple(sorted(os.sched_getaffinity(pid)))
    except OSError as e:
        return NA(f"PID {pid} CPU affinity: {e.strerror or e}")


def parse_cpulist(text: str) -> frozenset:
    cpus: set = set()
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            cpus.update(range(int(a), int(b) + 1))
        else:
            cpus.add(int(part))
    return frozenset(cpus)


def numa_nodes(root: Path = Path("/sys/devices/system/node")) -> Union[dict, NA]:
    try:
        out = {}
        for d in sorted(root.glob("node[0-9]*")):
            out[int(d.name[4:])] = parse_cpulist((d / "cpulist").read_text())
        return out or NA(f"{root}: no NUMA nodes listed")
    except (OSError, ValueError) as e:
        return NA(f"{root}: {e}")


def sysfs_bdf(pci_bus_id: str) -> str:
    """NVML's "00000000:19:00.0" -> sysfs's "0000:19:00.0"."""
    s = pci_bus_id.strip().lower()
    dom, _, rest = s.partition(":")
    return f"{dom[-4:]:0>4}:{rest}" if rest else s


def pcie_link(pci_bus_id: str, root: Path = Path("/sys/bus/pci/devices")) -> Union[dict, NA]:
    d = root / sysfs_bdf(pci_bus_id)
    out = {}
    for k in ("current_link_width", "max_link_width", "current_link_speed", "max_link_speed"):
        try:
            out[k] = (d / k).read_text().strip()
        except OSError as e:
            return NA(f"{d / k}: {e.strerror or e}")
    return out
