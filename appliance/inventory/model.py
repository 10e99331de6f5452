"""Typed inventory records. A field NVML cannot give is an ``NA`` carrying the reason, never a guess."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

SCHEMA_VERSION = 1


class InventoryError(RuntimeError):
    """Inventory cannot be read at all (NVML missing, driver not loaded, unreadable JSON)."""


@dataclass(frozen=True)
class NA:
    """A value that is not available, with the reason (rendered as ``NA`` by every view)."""
    reason: str

    def __str__(self) -> str:
        return "NA"

    def to_json(self) -> dict:
        return {"na": self.reason}


def is_na(value: Any) -> bool:
    return isinstance(value, NA)


def _dump(v: Any) -> Any:
    return v.to_json() if isinstance(v, NA) else v


def _load(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"na"}:
        return NA(str(v["na"]))
    return v


MaybeInt = Union[int, NA]
MaybeStr = Union[str, NA]


@dataclass(frozen=True)
class GPU:
    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    pci_bus_id: MaybeStr = NA("not read")
    numa_node: MaybeInt = NA("not read")
    cpu_affinity: Union[list, NA] = NA("not read")     # CPU ids close to this GPU
    compute_capability: MaybeStr = NA("not read")      # "9.0"
    mig_mode: MaybeStr = NA("not read")                # "disabled" | "enabled"
    nvlink_peers: tuple = ()                           # indices reachable over NVLink (P2P NVLink capability)

    def to_json(self) -> dict:
        return {
            "index": self.index, "uuid": self.uuid, "name": self.name,
            "memory_total_bytes": self.memory_total_bytes,
            "pci_bus_id": _dump(self.pci_bus_id), "numa_node": _dump(self.numa_node),
            "cpu_affinity": _dump(self.cpu_affinity),
            "compute_capability": _dump(self.compute_capability), "mig_mode": _dump(self.mig_mode),
            "nvlink_peers": list(self.nvlink_peers),
        }

    @classmethod
    def from_json(cls, d: dict) -> "GPU":
        return cls(
            index=int(d["index"]), uuid=str(d["uuid"]), name=str(d["name"]),
            memory_total_bytes=int(d["memory_total_bytes"]),
            pci_bus_id=_load(d.get("pci_bus_id", NA("absent in file"))),
            numa_node=_load(d.get("numa_node", NA("absent in file"))),
            cpu_affinity=_load(d.get("cpu_affinity", NA("absent in file"))),
            compute_capability=_load(d.get("compute_capability", NA("absent in file"))),
            mig_mode=_load(d.get("mig_mode", NA("absent in file"))),
            nvlink_peers=tuple(int(p) for p in d.get("nvlink_peers", [])),
        )


@dataclass(frozen=True)
class Inventory:
    gpus: tuple
    source: str                        # "nvml", "fake:8xH200", "file:/path", "none"
    driver_version: MaybeStr = NA("not read")
    cuda_version: MaybeStr = NA("not read")
    host_ram_bytes: int = 0
    cpu_count: int = 0
    hostname: str = ""
    extra: dict = field(default_factory=dict)

    def gpu(self, index: int) -> GPU:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(index)

    def nvlinked(self, a: int, b: int) -> bool:
        return b in self.gpu(a).nvlink_peers and a in self.gpu(b).nvlink_peers

    def islands(self) -> list[list[int]]:
        """Connected components of the NVLink graph (sorted GPU indices; singletons when no NVLink)."""
        seen: set[int] = set()
        out: list[list[int]] = []
        for g in sorted(self.gpus, key=lambda g: g.index):
            if g.index in seen:
                continue
            comp, stack = [], [g.index]
            while stack:
                i = stack.pop()
                if i in seen:
                    continue
                seen.add(i)
                comp.append(i)
                stack.extend(p for p in self.gpu(i).nvlink_peers if p not in seen and self.nvlinked(i, p))
            out.append(sorted(comp))
        return out

    def to_json(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION, "source": self.source,
            "driver_version": _dump(self.driver_version), "cuda_version": _dump(self.cuda_version),
            "host_ram_bytes": self.host_ram_bytes, "cpu_count": self.cpu_count, "hostname": self.hostname,
            "gpus": [g.to_json() for g in self.gpus],
        }

    @classmethod
    def from_json(cls, d: dict, source: str) -> "Inventory":
        return cls(
            gpus=tuple(GPU.from_json(g) for g in d.get("gpus", [])), source=source,
            driver_version=_load(d.get("driver_version", NA("absent in file"))),
            cuda_version=_load(d.get("cuda_version", NA("absent in file"))),
            host_ram_bytes=int(d.get("host_ram_bytes", 0)), cpu_count=int(d.get("cpu_count", 0)),
            hostname=str(d.get("hostname", "")),
        )
