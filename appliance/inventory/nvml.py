"""Real inventory through NVML (``nvidia-ml-py``, module ``pynvml``).

NVLink between two GPUs is read with ``nvmlDeviceGetP2PStatus(..., NVML_P2P_CAPS_INDEX_NVLINK)``:
the common-ancestor call only describes the PCIe path (it said HOSTBRIDGE for two NV18-linked H200s).
"""
from __future__ import annotations

from typing import Any, Callable

from .model import GPU, NA, Inventory, InventoryError


def _explain(exc: Exception, pynvml: Any) -> str:
    name = type(exc).__name__
    if isinstance(exc, getattr(pynvml, "NVMLError_LibraryNotFound", ())):
        return ("NVML library libnvidia-ml.so.1 not found: the NVIDIA driver is not installed on this host. "
                "Install the driver, or try `--gpus fake:4xH200` / `--simulate`.")
    if isinstance(exc, getattr(pynvml, "NVMLError_DriverNotLoaded", ())):
        return ("NVIDIA driver not loaded (NVML: Driver Not Loaded): run `modprobe nvidia` or check "
                "`dmesg | grep -i nvidia`; or try `--gpus fake:4xH200` / `--simulate`.")
    if isinstance(exc, getattr(pynvml, "NVMLError_NoPermission", ())):
        return "NVML: no permission to read the GPUs (run as root or a member of the video group)."
    return f"NVML failed: {name}: {exc}"


def _try(fn: Callable[[], Any], what: str, pynvml: Any) -> Any:
    try:
        return fn()
    except pynvml.NVMLError as exc:  # one field missing is NA, not a failure
        return NA(f"{what}: {exc}")


def _text(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


def read_nvml(host_ram_bytes: int, cpu_count: int, hostname: str) -> Inventory:
    try:
        import pynvml  # provided by nvidia-ml-py
    except ImportError as exc:
        raise InventoryError("Python package nvidia-ml-py (module pynvml) is not installed: "
                             "pip install nvidia-ml-py") from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise InventoryError(_explain(exc, pynvml)) from exc
    try:
        n = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        driver = _try(lambda: _text(pynvml.nvmlSystemGetDriverVersion()), "driver version", pynvml)

        def cuda() -> str:
            v = pynvml.nvmlSystemGetCudaDriverVersion_v2()
            return f"{v // 1000}.{(v % 1000) // 10}"
        cuda_v = _try(cuda, "CUDA driver version", pynvml)
        nvlink_idx = getattr(pynvml, "NVML_P2P_CAPS_INDEX_NVLINK", 3)
        ok = getattr(pynvml, "NVML_P2P_STATUS_OK", 0)
        gpus = []
        for i, h in enumerate(handles):
            peers = []
            for j, h2 in enumerate(handles):
                if i == j:
                    continue
                st = _try(lambda h=h, h2=h2: pynvml.nvmlDeviceGetP2PStatus(h, h2, nvlink_idx), "p2p", pynvml)
                if st == ok:
                    peers.append(j)

            def mig(h=h) -> str:
                cur, _pending = pynvml.nvmlDeviceGetMigMode(h)
                return "enabled" if cur else "disabled"

            def affinity(h=h) -> list:
                words = pynvml.nvmlDeviceGetCpuAffinity(h, max(1, (cpu_count + 63) // 64))
                return [w * 64 + b for w, mask in enumerate(words) for b in range(64) if mask >> b & 1]

            def cc(h=h) -> str:
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
                return f"{major}.{minor}"

            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            gpus.append(GPU(
                index=i, uuid=_text(pynvml.nvmlDeviceGetUUID(h)), name=_text(pynvml.nvmlDeviceGetName(h)),
                memory_total_bytes=int(mem.total),
                pci_bus_id=_try(lambda h=h: _text(pynvml.nvmlDeviceGetPciInfo(h).busId), "PCI info", pynvml),
                numa_node=_try(lambda h=h: int(pynvml.nvmlDeviceGetNumaNodeId(h)), "NUMA node", pynvml),
                cpu_affinity=_try(affinity, "CPU affinity", pynvml),
                compute_capability=_try(cc, "compute capability", pynvml),
                mig_mode=_try(mig, "MIG mode", pynvml),
                nvlink_peers=tuple(peers)))
        return Inventory(gpus=tuple(gpus), source="nvml", driver_version=driver, cuda_version=cuda_v,
                         host_ram_bytes=host_ram_bytes, cpu_count=cpu_count, hostname=hostname)
    except pynvml.NVMLError as exc:
        raise InventoryError(_explain(exc, pynvml)) from exc
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
