"""Per-GPU samples behind one small protocol, so NVML, the twin and tests are interchangeable.

NVML is initialised once per process (lazily, ~16 ms) and every query that fails yields ``NA`` with the
NVML error, as nvitop does; the steady-state cost is ~0.02 ms per GPU per poll on an H200 host.
Memory uses the v2 struct where available: v1 counts the driver's reserved memory as "used".
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Union

from appliance.inventory import NA

Num = Union[float, NA]


@dataclass(frozen=True)
class RawGpu:
    index: int
    name: str
    util_pct: Num
    mem_used_bytes: Union[int, NA]
    mem_total_bytes: Union[int, NA]
    temp_c: Num
    power_w: Num
    power_limit_w: Num
    processes: tuple = ()        # (pid, used_bytes | NA)


class GpuSampler(Protocol):
    """Anything that can sample the GPUs; ``sample()`` returns NA (with why) when it cannot at all."""
    source: str

    def sample(self) -> Union[list[RawGpu], NA]: ...

    def close(self) -> None: ...


class NoGpus:
    """A host (or stack) without GPU samples: the GPU table says why and everything else stays live."""

    def __init__(self, reason: str, source: str = "none"):
        self.reason = reason
        self.source = source

    def sample(self) -> Union[list[RawGpu], NA]:
        return NA(self.reason)

    def close(self) -> None:
        pass


class NvmlSampler:
    source = "nvml"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nvml: Any = None
        self._handles: list = []
        self._names: list[str] = []
        self._failed: NA | None = None

    def _init(self) -> Union[NA, None]:
        if self._nvml is not None or self._failed is not None:
            return self._failed
        try:
            import pynvml
        except ImportError:
            self._failed = NA("nvidia-ml-py not installed (pip install nvidia-ml-py)")
            return self._failed
        try:
            pynvml.nvmlInit()
            n = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
            self._names = []
            for h in self._handles:
                name = pynvml.nvmlDeviceGetName(h)
                self._names.append(name.decode() if isinstance(name, bytes) else str(name))
        except pynvml.NVMLError as e:
            kind = type(e).__name__
            hint = "NVIDIA driver not installed" if "LibraryNotFound" in kind else (
                "NVIDIA driver not loaded" if "DriverNotLoaded" in kind else f"NVML error: {e}")
            self._failed = NA(f"NVML missing: {hint}")
            return self._failed
        self._nvml = pynvml
        return None

    def _q(self, fn: Callable[[], Any], what: str) -> Any:
        try:
            return fn()
        except self._nvml.NVMLError as e:
            return NA(f"{what}: {e}")

    def sample(self) -> Union[list[RawGpu], NA]:
        with self._lock:
            failed = self._init()
            if failed is not None:
                return failed
            nv = self._nvml
            out = []
            for i, h in enumerate(self._handles):
                util = self._q(lambda h=h: float(nv.nvmlDeviceGetUtilizationRates(h).gpu), "utilization")

                def mem(h=h) -> Any:
                    try:
                        return nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
                    except (AttributeError, TypeError, nv.NVMLError):
                        return nv.nvmlDeviceGetMemoryInfo(h)
                m = self._q(mem, "memory")
                temp = self._q(lambda h=h: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                               "temperature")
                power = self._q(lambda h=h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0, "power")
                limit = self._q(lambda h=h: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0, "power limit")
                procs = self._q(lambda h=h: nv.nvmlDeviceGetComputeRunningProcesses(h), "processes")
                plist = () if isinstance(procs, NA) else tuple(
                    (int(p.pid), int(p.usedGpuMemory) if p.usedGpuMemory is not None else NA("not reported"))
                    for p in procs)
                out.append(RawGpu(
                    index=i, name=self._names[i], util_pct=util,
                    mem_used_bytes=m if isinstance(m, NA) else int(m.used),
                    mem_total_bytes=m if isinstance(m, NA) else int(m.total),
                    temp_c=temp, power_w=power, power_limit_w=limit, processes=plist))
            return out

    def close(self) -> None:
        with self._lock:
            if self._nvml is not None:
                try:
                    self._nvml.nvmlShutdown()
                except self._nvml.NVMLError:
                    pass
                self._nvml = None


def _field(obj: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        if isinstance(obj, dict) and n in obj:
            return obj[n]
        if hasattr(obj, n):
            return getattr(obj, n)
    return default


def _num(v: Any, what: str) -> Any:
    return NA(f"{what} not reported by the sampler") if v is None else v


def _procs(procs: Any) -> tuple:
    return tuple((int(_field(p, "pid", default=0)), _field(p, "used_bytes", "used_gpu_memory",
                                                           default=NA("memory not reported")))
                 if not isinstance(p, tuple) else p for p in procs)


def adapt_record(rec: Any, default_index: int = 0) -> RawGpu:
    """Map one twin/other sample record (dataclass or dict, NVML-like field names) onto ``RawGpu``."""
    if not isinstance(rec, dict):
        try:            # a record with every canonical field (the twin's GpuSample): no name probing
            index, name, util, used, total, temp, power, limit, procs = (
                rec.index, rec.name, rec.util_pct, rec.mem_used_bytes, rec.mem_total_bytes, rec.temp_c,
                rec.power_w, rec.power_limit_w, rec.processes)
        except AttributeError:
            pass
        else:
            return RawGpu(index=int(index), name=str(name), util_pct=_num(util, "utilization"),
                          mem_used_bytes=_num(used, "memory used"), mem_total_bytes=_num(total, "memory total"),
                          temp_c=_num(temp, "temperature"), power_w=_num(power, "power"),
                          power_limit_w=_num(limit, "power limit"), processes=_procs(procs or ()))
    procs = _field(rec, "processes", default=()) or ()
    return RawGpu(
        index=int(_field(rec, "index", default=default_index)),
        name=str(_field(rec, "name", default="twin GPU")),
        util_pct=_num(_field(rec, "util_pct", "utilization_pct", "utilization", "gpu_util"), "utilization"),
        mem_used_bytes=_num(_field(rec, "mem_used_bytes", "memory_used_bytes", "used_bytes"), "memory used"),
        mem_total_bytes=_num(_field(rec, "mem_total_bytes", "memory_total_bytes", "total_bytes"), "memory total"),
        temp_c=_num(_field(rec, "temp_c", "temperature_c", "temperature"), "temperature"),
        power_w=_num(_field(rec, "power_w", "power_watts"), "power"),
        power_limit_w=_num(_field(rec, "power_limit_w", "power_limit_watts"), "power limit"),
        processes=_procs(procs),
    )


class CallableSampler:
    """Adapter point for the twin (``appliance/twin/gpus.py``) or any other source of NVML-shaped samples.

    ``fn()`` returns an iterable of records with NVML-like fields (see ``adapt_record``), or raises:
    an exception becomes NA with its text, so a broken twin degrades the GPU table only.
    """

    def __init__(self, fn: Callable[[], Any], source: str = "twin"):
        self._fn = fn
        self.source = source

    def sample(self) -> Union[list[RawGpu], NA]:
        try:
            recs = list(self._fn())
        except Exception as e:  # noqa: BLE001 - any failure of a foreign source is rendered, not raised
            return NA(f"{self.source} GPU sampler failed: {type(e).__name__}: {e}")
        return [r if isinstance(r, RawGpu) else adapt_record(r, i) for i, r in enumerate(recs)]

    def close(self) -> None:
        pass


def twin_sampler(**kwargs: Any) -> Union[GpuSampler, NoGpus]:
    """The twin's GPUs through ``appliance.twin.gpus.sample(**kwargs)`` (``state_dir``, ``inventory``).

    The twin engines write NVML-shaped JSON state files; ``sample`` reads them (idle GPUs included when an
    inventory is given). Without that module the GPU table is NA with the reason.
    """
    try:
        from appliance.twin import gpus as twin_gpus  # type: ignore[attr-defined]
    except ImportError as e:
        return NoGpus(f"twin GPU sampler unavailable ({e})", source="twin")
    fn = getattr(twin_gpus, "sample", None)
    if not callable(fn):
        return NoGpus("appliance.twin.gpus has no sample()", source="twin")
    return CallableSampler(lambda: fn(**kwargs), source="twin")


def default_sampler(plan: Any) -> Union[GpuSampler, NoGpus]:
    """NVML for real engines, the twin's samples for twin stacks, nothing for CPU engines."""
    engine = getattr(plan, "engine", plan)
    if engine == "twin":
        inventory = None
        src = getattr(plan, "inventory_source", "") or ""
        if src.startswith(("twin:", "fake:")):
            try:
                from appliance.inventory import detect
                inventory = detect(src)
            except Exception:  # noqa: BLE001 - without the inventory only GPUs with state files show
                inventory = None
        return twin_sampler(inventory=inventory)
    if engine == "vllm-cpu":
        return NoGpus("CPU engine: no GPUs in this plan", source="none")
    return NvmlSampler()
