"""The collector: UI-free, one immutable Snapshot per tick from NVML/twin, systemd and HTTP scrapes.

``Collector(plan, gpu_sampler=..., interval=...)`` runs the background thread (``start/stop/latest``);
``collect_once(plan, ...)`` takes one Snapshot for ``pdctl status``. Views only render Snapshots.

May import: policy, inventory, twin, wire
"""
from .collector import Collector, collect_once
from .gpus import CallableSampler, GpuSampler, NoGpus, NvmlSampler, RawGpu, default_sampler, twin_sampler
from .snapshot import Snapshot
from .units import NoUnits, SystemctlUnits, UnitSource

__all__ = ["Collector", "collect_once", "Snapshot", "GpuSampler", "NvmlSampler", "NoGpus", "CallableSampler",
           "RawGpu", "default_sampler", "twin_sampler", "SystemctlUnits", "NoUnits", "UnitSource"]
