"""Fake inventories (``fake:8xH200``, ``fake:2xA100-80GB+2xH100``): deterministic boxes for planning and tests.

GPU kinds carry the memory NVML reports on real boards; GPUs of one kind on one fake box form one
NVLink island (SXM boards with NVSwitch), different kinds are not linked. Host RAM is 256 GiB per GPU
(typical for 8-GPU servers: 2 TiB), CPUs 16 per GPU, split over 2 NUMA nodes.
"""
from __future__ import annotations

import re
import uuid as _uuid

from .model import GPU, NA, Inventory, InventoryError

MiB = 1024**2
GiB = 1024**3

# name NVML reports, memory NVML reports (MiB), compute capability
GPU_KINDS: dict[str, tuple[str, int, str]] = {
    "H200": ("NVIDIA H200", 143771, "9.0"),
    "H100": ("NVIDIA H100 80GB HBM3", 81559, "9.0"),
    "H100-80GB": ("NVIDIA H100 80GB HBM3", 81559, "9.0"),
    "A100-80GB": ("NVIDIA A100-SXM4-80GB", 81920, "8.0"),
    "A100-40GB": ("NVIDIA A100-SXM4-40GB", 40960, "8.0"),
    "B200": ("NVIDIA B200", 183359, "10.0"),
    "L40S": ("NVIDIA L40S", 46068, "8.9"),
}
NVLINK_KINDS = {"H200", "H100", "H100-80GB", "A100-80GB", "A100-40GB", "B200"}

_PART = re.compile(r"^(\d+)x([A-Za-z0-9-]+)$")


def parse_fake(spec: str) -> Inventory:
    body = spec.split(":", 1)[1] if ":" in spec else spec
    if not body:
        raise InventoryError(f"--gpus {spec!r}: empty fake spec; example: fake:8xH200 or fake:2xA100-80GB+2xH100")
    kinds: list[str] = []
    for part in body.split("+"):
        m = _PART.match(part.strip())
        if not m:
            raise InventoryError(f"--gpus {spec!r}: cannot read {part!r}; write COUNTxKIND, e.g. 4xH200")
        count, kind = int(m.group(1)), m.group(2)
        key = next((k for k in GPU_KINDS if k.lower() == kind.lower()), None)
        if key is None:
            raise InventoryError(f"--gpus {spec!r}: unknown GPU kind {kind!r}; known: {', '.join(GPU_KINDS)}")
        if count < 1 or count > 64:
            raise InventoryError(f"--gpus {spec!r}: count {count} out of range 1..64")
        kinds += [key] * count
    n = len(kinds)
    gpus = []
    for i, kind in enumerate(kinds):
        name, mem_mib, cc = GPU_KINDS[kind]
        same = [j for j, k in enumerate(kinds) if k == kind and j != i] if kind in NVLINK_KINDS else []
        numa = 0 if i < (n + 1) // 2 else 1
        cpus_per_numa = 8 * n
        gpus.append(GPU(
            index=i, uuid="GPU-" + str(_uuid.uuid5(_uuid.NAMESPACE_URL, f"pdctl-fake/{spec}/{i}")), name=name,
            memory_total_bytes=mem_mib * MiB, pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0",
            numa_node=numa, cpu_affinity=list(range(numa * cpus_per_numa, (numa + 1) * cpus_per_numa)),
            compute_capability=cc, mig_mode="disabled", nvlink_peers=tuple(same)))
    return Inventory(gpus=tuple(gpus), source=f"fake:{body}", driver_version="580.159.04 (fake)",
                     cuda_version="13.0 (fake)", host_ram_bytes=256 * GiB * n, cpu_count=16 * n,
                     hostname="fake-box")


def no_gpus(host_ram_bytes: int, cpu_count: int, hostname: str) -> Inventory:
    return Inventory(gpus=(), source="none", driver_version=NA("no GPUs asked for (--gpus none)"),
                     cuda_version=NA("no GPUs asked for (--gpus none)"), host_ram_bytes=host_ram_bytes,
                     cpu_count=cpu_count, hostname=hostname)
