"""Wait until the GPUs of a worker have the memory its engine will ask for.

Why: after a crash or restart the previous engine's memory is released only when its last process is
gone, and vLLM refuses to start when free memory is below ``--gpu-memory-utilization`` x total. So the
criterion is exactly vLLM's: used memory at most ``(1 - fraction) x total``. Other compute processes
(the LMCache server keeps a small CUDA context on its GPU) are fine as long as that holds; the ones that
hold memory are named while we wait. Without NVML (twin or CPU engines, no driver) the wait is skipped.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

MIB = 1024 * 1024


@dataclass(frozen=True)
class GpuUse:
    index: int
    total_bytes: int
    used_bytes: int
    pids: tuple = ()   # compute processes on this GPU (PIDs in NVML's view)


@dataclass(frozen=True)
class GpuWait:
    ok: bool
    waited_s: float
    message: str       # one line for logs / STATUS=


Reader = Callable[[Sequence[int]], "list[GpuUse]"]


def memory_fraction(argv: Sequence[str], default: float = 0.9) -> float:
    """The ``--gpu-memory-utilization`` an engine argv asks for (vLLM's default 0.9 when absent)."""
    args = list(argv)
    for i, a in enumerate(args):
        if a.startswith("--gpu-memory-utilization="):
            value = a.split("=", 1)[1]
        elif a == "--gpu-memory-utilization" and i + 1 < len(args):
            value = args[i + 1]
        else:
            continue
        try:
            f = float(value)
        except ValueError:
            return default
        return f if 0.0 < f <= 1.0 else default
    return default


def nvml_reader() -> "tuple[Reader | None, str]":
    """A reader over NVML, or None and the reason NVML cannot be used here."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None, "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return None, f"NVML unavailable ({exc})"

    def read(indices: Sequence[int]) -> list:
        out = []
        for i in indices:
            h = pynvml.nvmlDeviceGetHandleByIndex(int(i))
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            try:
                procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            except pynvml.NVMLError:
                procs = []
            out.append(GpuUse(int(i), int(mem.total), int(mem.used), tuple(int(p.pid) for p in procs)))
        return out
    return read, ""


def nvml_close() -> None:
    """Release NVML once the wait is over (the launcher then lives for days without needing it)."""
    try:
        import pynvml
        pynvml.nvmlShutdown()
    except Exception:  # not initialised, or no library: nothing to release
        pass


def _busy(uses: Sequence[GpuUse], fraction: float) -> list:
    return [u for u in uses if u.used_bytes > (1.0 - fraction) * u.total_bytes]


def describe(u: GpuUse, fraction: float) -> str:
    need = fraction * u.total_bytes
    free = u.total_bytes - u.used_bytes
    who = f", held by pid {', '.join(map(str, u.pids))}" if u.pids else ""
    return (f"GPU {u.index}: {free / MIB:,.0f} MiB free, engine needs {need / MIB:,.0f} MiB "
            f"({fraction:g} of {u.total_bytes / MIB:,.0f}){who}")


def wait_free(indices: Sequence[int], fraction: float, reader: Reader, timeout_s: float = 120.0,
              poll_s: float = 1.0, on_wait: Callable[[str, float], None] | None = None,
              clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep) -> GpuWait:
    """Poll until every GPU in ``indices`` has ``fraction`` of its memory free, or ``timeout_s`` passes."""
    t0 = clock()
    while True:
        try:
            busy = _busy(reader(indices), fraction)
        except Exception as exc:  # NVML errors on one read: report, do not crash the unit
            return GpuWait(False, clock() - t0, f"reading GPU memory failed: {type(exc).__name__}: {exc}")
        waited = clock() - t0
        if not busy:
            gpus = ", ".join(map(str, indices))
            return GpuWait(True, waited, f"GPU {gpus}: memory free after {waited:.1f} s")
        text = "; ".join(describe(u, fraction) for u in busy)
        if waited >= timeout_s:
            return GpuWait(False, waited, f"GPU memory still in use after {waited:.0f} s: {text}. "
                                          f"Stop the process holding it (nvidia-smi shows it) and the unit "
                                          f"will start on its next restart.")
        if on_wait is not None:
            on_wait(f"waiting for GPU memory, {waited:.0f} s: {text}", waited)
        sleep(poll_s)
