"""GPU hardware profiles: the physical numbers the cost model starts from.

Each number is a datasheet value (dense, no sparsity) or what NVML reports; the fitted efficiency
factors that turn peaks into achieved rates live in ``params.CostParams`` / ``params.HARDWARE_FITS``,
never here.

Sources:
- A100-80GB SXM4: NVIDIA A100 datasheet (312 TFLOPS BF16 dense, 2,039 GB/s HBM2e, 400 W, PCIe Gen4 x16).
- H100-80GB SXM5: NVIDIA H100 datasheet (989 TFLOPS BF16 dense, 3.35 TB/s HBM3, 700 W, PCIe Gen5 x16).
- H200 SXM: NVIDIA H200 datasheet (989 TFLOPS BF16 dense, 4.8 TB/s HBM3e, 141 GB, 700 W, PCIe Gen5 x16).
- B200 (HGX): NVIDIA HGX B200 datasheet (2.25 PFLOPS BF16 dense per GPU, 8 TB/s HBM3e, 180 GB, 1,000 W;
  host link PCIe Gen5 x16 in HGX B200 systems).
- Host link: PCIe Gen4 x16 = 32 GB/s per direction, Gen5 x16 = 64 GB/s per direction (PCI-SIG). The
  H200 spike in ``reference/gpu-h200.md`` measured LMCache L1->GPU loads at 43 GB/s and stores at
  54 GB/s over Gen5, i.e. 67-84 % of the per-direction peak.
- NVML names and memory totals: what NVML reports, taken from ``appliance.inventory.fake.GPU_KINDS``.
- Idle power: typical ``nvidia-smi`` idle readings for SXM boards (used only by the twin GPU samples).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from appliance.inventory.fake import GPU_KINDS

MiB = 1024**2


class HardwareError(ValueError):
    """A hardware name the twin has no profile for."""


@dataclass(frozen=True)
class Hardware:
    name: str                  # profile key, e.g. "a100-80gb"
    nvml_name: str             # what NVML reports (the twin GPUs show this)
    memory_bytes: int          # total device memory as NVML reports it
    bf16_flops: float          # peak dense BF16 tensor FLOP/s
    hbm_bytes_per_s: float     # peak device-memory bandwidth
    host_link_bytes_per_s: float  # host<->GPU, per direction (PCIe)
    tdp_w: float               # board power limit
    idle_w: float              # idle power draw
    source: str

    def to_dict(self) -> dict:
        return asdict(self)


def _board(name: str, kind: str, **datasheet) -> Hardware:
    """A profile whose NVML name and memory total are the fake inventory's ``kind`` (one owner of what NVML
    reports); the rest from the datasheet."""
    nvml_name, memory_mib, _ = GPU_KINDS[kind]
    return Hardware(name=name, nvml_name=nvml_name, memory_bytes=memory_mib * MiB, **datasheet)


PROFILES: dict[str, Hardware] = {
    "a100-80gb": _board("a100-80gb", "A100-80GB", bf16_flops=312e12, hbm_bytes_per_s=2.039e12,
                        host_link_bytes_per_s=32e9, tdp_w=400.0, idle_w=60.0,
                        source="NVIDIA A100 datasheet (SXM4 80GB); PCIe Gen4 x16"),
    "h100-80gb": _board("h100-80gb", "H100-80GB", bf16_flops=989e12, hbm_bytes_per_s=3.35e12,
                        host_link_bytes_per_s=64e9, tdp_w=700.0, idle_w=70.0,
                        source="NVIDIA H100 datasheet (SXM5); PCIe Gen5 x16"),
    "h200": _board("h200", "H200", bf16_flops=989e12, hbm_bytes_per_s=4.8e12, host_link_bytes_per_s=64e9,
                   tdp_w=700.0, idle_w=75.0, source="NVIDIA H200 datasheet (SXM); PCIe Gen5 x16"),
    "b200": _board("b200", "B200", bf16_flops=2.25e15, hbm_bytes_per_s=8.0e12, host_link_bytes_per_s=64e9,
                   tdp_w=1000.0, idle_w=120.0, source="NVIDIA HGX B200 datasheet; PCIe Gen5 x16 host link"),
}

ALIASES = {
    "a100": "a100-80gb", "a100-sxm4-80gb": "a100-80gb", "nvidia a100-sxm4-80gb": "a100-80gb",
    "h100": "h100-80gb", "h100-sxm": "h100-80gb", "nvidia h100 80gb hbm3": "h100-80gb",
    "h200-141gb": "h200", "nvidia h200": "h200", "b200-180gb": "b200", "nvidia b200": "b200",
}


def resolve(name: str) -> Hardware:
    """Profile key, alias or NVML name (case-insensitive) -> Hardware; else HardwareError."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key in PROFILES:
        return PROFILES[key]
    raise HardwareError(f"unknown hardware {name!r}: use one of {', '.join(PROFILES)}")
