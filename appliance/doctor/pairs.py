"""The engine / connector / torch versions pdctl has run, and the traps found around them: one table.

``pdctl doctor`` compares an engine venv against ``TESTED_PAIRS`` (exact match: ok), the known ``TRAPS``
(a match: fail or warn with the fix), and otherwise says the combination is untested. Every row names
where it was measured. The ``flags_version`` of a pair is the key of ``engine_flags.ENGINE_VERSIONS``
whose argv the planner writes for that engine (tests keep the two tables in step).
Pure data and pure functions: no I/O here.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class TestedPair:
    engine: str              # the plan's engine: "vllm" (CUDA) | "vllm-cpu"
    flags_version: str       # engine_flags.ENGINE_VERSIONS key ("0.26.0", "0.32.0+cpu")
    dist: str                # the engine's distribution name in the venv ("vllm" | "vllm-cpu")
    dist_version: str        # its version as importlib.metadata reports it
    lmcache: str
    torch: str               # torch's version string as installed ("2.13.0+cpu")
    source: str

    def text(self) -> str:
        return f"{self.dist} {self.dist_version} + lmcache {self.lmcache} + torch {self.torch}"


TESTED_PAIRS: tuple[TestedPair, ...] = (
    TestedPair("vllm", "0.26.0", "vllm", "0.26.0", "0.5.3", "2.11.0",
               "measured on one H200 2026-11-30 and 2026-12-01 (shared/reference/gpu-h200.md: vllm serve + "
               "lmcache server via kv_connector_module_path, 1792 external hits; two kv_both engines sharing "
               "one server); installed by scripts/install-engines.sh gpu"),
    TestedPair("vllm-cpu", "0.32.0+cpu", "vllm-cpu", "0.32.0", "0.5.6", "2.13.0+cpu",
               "every CI run on the CPU stack (tests/real, docs/real-engines.md, shared/reference/vllm-cpu.md); "
               "installed by scripts/install-engines.sh cpu"),
)

# torch each vLLM release is built against (its compiled ops do not load against another torch)
# (first vLLM, last vLLM, torch); source: shared/reference/vllm-and-peers.md "Torch pins by vLLM release"
TORCH_PINS: tuple[tuple[str, str, str], ...] = (
    ("0.26.0", "0.26.999", "2.11.0"),
    ("0.27.0", "0.32.999", "2.13.0"),
    ("0.33.0", "0.33.999", "2.14.0"),
)
TORCH_PINS_SOURCE = "shared/reference/vllm-and-peers.md (torch pins by vLLM release)"


@dataclass(frozen=True)
class Trap:
    key: str
    status: str              # "fail" | "warn"
    what: str                # what breaks in the field
    fix: str
    source: str


TRAPS: dict[str, Trap] = {t.key: t for t in (
    Trap("lmcache-0.5.4-0.5.6-torch-2.11", "fail",
         "lmcache 0.5.4-0.5.6 cuda_ops*.so do not load against torch 2.11 (undefined symbol "
         "c10::NotImplementedError...: built against a newer torch)",
         "install the tested GPU pair: scripts/install-engines.sh gpu VENV (vllm 0.26.0 + lmcache 0.5.3), "
         "or a vLLM whose torch matches the lmcache build",
         "shared/reference/gpu-h200.md, errors met 4"),
    Trap("torch-pin", "fail",
         "vLLM's compiled ops are built against one torch release; another torch fails at import or at the "
         "first kernel call",
         "reinstall the engine venv with scripts/install-engines.sh (one resolve pins the pair's torch)",
         TORCH_PINS_SOURCE),
    Trap("lmcache-cuda-driver", "fail",
         "lmcache's CUDA extension links a newer CUDA runtime than the driver supports (lmcache 0.5.x wheels "
         "on PyPI are CUDA 13 builds: libcudart.so.13, cupy-cuda13x; they need a CUDA 13 driver, >= 580)",
         "upgrade the NVIDIA driver to one that reports CUDA >= the lmcache build's major (nvidia-smi), or "
         "build lmcache for the driver's CUDA",
         "shared/reference/lmcache-mp.md section 1; shared/reference/gpu-h200.md (driver 580.159.04)"),
    Trap("lmcache-cuda-torch", "warn",
         "lmcache's CUDA build and torch's CUDA build differ in major version (CUDA 12 torch + CUDA 13 "
         "lmcache): two CUDA runtimes in one process, untested",
         "use a torch built for the same CUDA major as lmcache (the tested pairs do), or build lmcache "
         "against the installed torch",
         "shared/reference/lmcache-mp.md section 1 (lmcache 0.5.6 links libcudart.so.13)"),
    Trap("lmcache-client-server", "fail",
         "the engines' lmcache (the connector) and the KV server's lmcache differ: 'Payload count mismatch "
         "... version mismatch between the lmcache client and lmcache server'",
         "run the KV server from the engine venv (the plan's kv_server argv does) and restart pd.target",
         "shared/reference/lmcache-mp.md section 7"),
    Trap("module-path", "warn",
         "the connector config has no kv_connector_module_path: vLLM then uses its own built-in "
         "LMCacheMPConnector copy, whose kv_role / HMA / autostart handling lags the installed lmcache "
         "(older copies fail with 'Unsupported GPUKVFormat: 7' on vLLM >= 0.20)",
         "set \"kv_connector_module_path\": \"lmcache.integration.vllm.lmcache_mp_connector\" (the planner "
         "does: re-run `sudo pdctl apply`)",
         "shared/reference/lmcache-mp.md section 4.1"),
)}


def vkey(version: str) -> tuple:
    """Numeric key of a version's release part ("0.32.0+cpu" -> (0, 32, 0))."""
    out = []
    for part in re.split(r"[.+-]", version.split("+")[0]):
        m = re.match(r"\d+", part)
        if m is None:
            break
        out.append(int(m.group()))
    return tuple(out)


def base(version: str) -> str:
    """A version without its local part ("2.13.0+cpu" -> "2.13.0")."""
    return version.split("+", 1)[0]


def torch_pin(vllm_version: str) -> Optional[str]:
    v = vkey(vllm_version)
    for lo, hi, torch in TORCH_PINS:
        if vkey(lo) <= v <= vkey(hi):
            return torch
    return None


def find_pair(engine: str, dist_version: str, lmcache: str, torch: str) -> Optional[TestedPair]:
    for p in TESTED_PAIRS:
        if (p.engine == engine and p.dist_version == dist_version and p.lmcache == lmcache
                and p.torch == torch):
            return p
    return None


def pairs_for(engine: str) -> tuple[TestedPair, ...]:
    return tuple(p for p in TESTED_PAIRS if p.engine == engine)


@dataclass(frozen=True)
class Finding:
    status: str              # "ok" | "warn" | "fail"
    text: str
    fix: str = ""
    source: str = ""


def judge(engine: str, dist_version: str, lmcache: Optional[str], torch: Optional[str], *,
          torch_cuda: Optional[str] = None, lmcache_cuda_major: Optional[int] = None,
          driver_cuda: Optional[str] = None, server_lmcache: Optional[str] = None) -> list[Finding]:
    """Findings for one engine venv (pure). ``torch_cuda`` is torch's CUDA build ("13.0", None for CPU),
    ``lmcache_cuda_major`` the libcudart major lmcache's extension links, ``driver_cuda`` what the driver
    supports ("13.0"), ``server_lmcache`` the KV server's own version string when it reports one."""
    out: list[Finding] = []
    gpu = engine == "vllm"

    def trap(key: str, detail: str) -> None:
        t = TRAPS[key]
        out.append(Finding(t.status, f"{detail}: {t.what}", t.fix, t.source))

    if lmcache and torch and gpu and vkey("0.5.4") <= vkey(lmcache) <= vkey("0.5.6") and vkey(torch)[:2] == (2, 11):
        trap("lmcache-0.5.4-0.5.6-torch-2.11", f"lmcache {lmcache} with torch {torch}")
    pin = torch_pin(dist_version)
    if torch and pin and base(torch) != pin:
        trap("torch-pin", f"{engine} {dist_version} is built against torch {pin}, the venv has torch {torch}")
    if gpu and lmcache_cuda_major and driver_cuda:
        try:
            drv_major = int(str(driver_cuda).split(".")[0])
        except ValueError:
            drv_major = 0
        if drv_major and drv_major < lmcache_cuda_major:
            trap("lmcache-cuda-driver", f"lmcache links CUDA {lmcache_cuda_major}, the driver supports CUDA "
                                        f"{driver_cuda}")
    if gpu and lmcache_cuda_major and torch_cuda:
        try:
            t_major = int(str(torch_cuda).split(".")[0])
        except ValueError:
            t_major = 0
        if t_major and t_major != lmcache_cuda_major:
            trap("lmcache-cuda-torch", f"torch is a CUDA {torch_cuda} build, lmcache links CUDA "
                                       f"{lmcache_cuda_major}")
    if lmcache and server_lmcache and base(server_lmcache.split("-g")[0]) != base(lmcache):
        trap("lmcache-client-server", f"KV server reports lmcache {server_lmcache}, the engine venv has {lmcache}")
    if any(f.status != "ok" for f in out):
        return out
    pair = find_pair(engine, dist_version, lmcache or "", torch or "")
    if pair is not None:
        out.append(Finding("ok", f"tested pair {pair.text()}", source=pair.source))
    else:
        tested = "; ".join(p.text() for p in pairs_for(engine)) or "none for this engine"
        out.append(Finding("warn", f"untested combination {engine} {dist_version} + lmcache {lmcache or 'absent'} "
                                   f"+ torch {torch or 'absent'} (tested: {tested})",
                           "install a tested pair with scripts/install-engines.sh, or run the real-engine tests "
                           "(tests/real) against this venv and add the pair to appliance/doctor/pairs.py",
                           "appliance/doctor/pairs.py"))
    return out
