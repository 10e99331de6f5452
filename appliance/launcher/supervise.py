"""Run one engine under systemd's Type=notify contract.

The launcher is the unit's main process; the engine is its child in its own process group. systemd
learns the truth from us: STATUS= while loading, EXTEND_TIMEOUT_USEC= so a long load is not killed by
the start timeout (but only up to ``load_timeout_s``: a hung load must still fail), READY=1 once
``/health`` answers 200, and WATCHDOG=1 only while ``/health`` keeps answering 200, so a wedged engine is
restarted by systemd's watchdog. SIGTERM/SIGINT/SIGHUP are forwarded to the engine's process group,
and the launcher ends the way the engine ended (same exit code, or death by the same signal), so
``Restart=on-failure`` sees what the engine did.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable

from .. import sdnotify
from . import health as healthmod
from .gpufree import GpuWait, memory_fraction, nvml_close, nvml_reader, wait_free

log = logging.getLogger("pdctl.launcher")

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the engine, before exec: SIGTERM it if the launcher dies (kill -9, watchdog abort), so no
    engine outlives its unit's main process holding the GPU and the port until systemd's final SIGKILL."""
    parent = os.getppid()
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:   # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


@dataclass(frozen=True)
class Timing:
    probe_timeout_s: float = 2.0       # short: vLLM binds its port before the model is loaded
    load_probe_s: float = 1.0          # probe cadence while loading (5x faster in the first 5 s: twin
                                       # engines and small models are up within a second or two)
    serve_probe_s: float = 5.0         # probe cadence once ready (also bounded by the watchdog period)
    extend_step_s: float = 30.0        # each EXTEND_TIMEOUT_USEC asks for this much more time
    load_timeout_s: float = 1800.0     # give up (stop the engine, exit 1) when not healthy by then
    stop_grace_s: float = 60.0         # SIGKILL the group if it ignores the forwarded signal this long
    gpu_wait_s: float = 120.0          # how long to wait for the previous process's GPU memory
    gpu_poll_s: float = 1.0


@dataclass(frozen=True)
class EngineSpec:
    name: str                          # instance name, e.g. "prefill-0" or "kvserver"
    argv: tuple                        # engine command (argv form)
    env: dict                          # the engine's full environment
    health_url: str
    loading: str = "loading model"     # STATUS= prefix while not yet healthy
    serving: str = "serving"           # STATUS= once healthy
    gpus: tuple = ()                   # NVML indices to wait for before start
    gpu_check: str = ""                # non-empty: why the GPU memory wait is skipped
    timing: Timing = field(default_factory=Timing)
    needs_url: str = ""                # health URL of what the engine waits for while loading (the KV server):
    #                                    named in STATUS= when it does not answer, so "stuck waiting for LMCache"
    #                                    is not mistaken for a slow model load


@dataclass
class _State:
    stop_signal: int = 0
    stop_at: float = 0.0
    killed: bool = False


def child_env(spec_env: dict, base: dict | None = None) -> dict:
    """The engine's environment: ours plus the plan's, minus what ties *us* to systemd."""
    env = dict(os.environ if base is None else base)
    env.update({str(k): str(v) for k, v in spec_env.items()})
    for k in sdnotify.SYSTEMD_ONLY_ENV:
        env.pop(k, None)
    return env


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _reap_group(pgid: int, grace_s: float = 5.0) -> None:
    """Engines leave helpers behind (vLLM's engine core); end what is left of the group."""
    if not _signal_group(pgid, 0):
        return
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _signal_group(pgid, 0):
            return
        time.sleep(0.05)
    _signal_group(pgid, signal.SIGKILL)


def wait_for_gpus(spec: EngineSpec, reader=None) -> GpuWait:
    """The pre-start GPU memory wait (skipped, with the reason, for engines without real GPUs)."""
    if spec.gpu_check:
        return GpuWait(True, 0.0, f"GPU memory wait skipped: {spec.gpu_check}")
    if not spec.gpus:
        return GpuWait(True, 0.0, "GPU memory wait skipped: the engine uses no GPU")
    own = reader is None
    if own:
        reader, why = nvml_reader()
        if reader is None:
            return GpuWait(True, 0.0, f"GPU memory wait skipped: {why}")
    fraction = memory_fraction(spec.argv)
    last_extend = [0.0]

    def on_wait(text: str, waited: float) -> None:
        sdnotify.status(text)
        if waited - last_extend[0] >= spec.timing.extend_step_s / 2 or last_extend[0] == 0.0:
            sdnotify.extend_timeout(spec.timing.extend_step_s)
            last_extend[0] = waited or 1e-9
    try:
        return wait_free(spec.gpus, fraction, reader, timeout_s=spec.timing.gpu_wait_s,
                         poll_s=spec.timing.gpu_poll_s, on_wait=on_wait)
    finally:
        if own:
            nvml_close()


def run(spec: EngineSpec, probe: Callable[[str, float], healthmod.Probe] = healthmod.probe) -> int:
    """Start the engine, report to systemd until it exits; returns its status (negative: signal)."""
    t = spec.timing
    gw = wait_for_gpus(spec)
    log.info(gw.message)
    if not gw.ok:
        sdnotify.status(gw.message)
        return 1

    state = _State()
    group = [0]  # the engine's process group, once it exists

    def forward(signum, _frame):
        if not state.stop_signal:
            state.stop_signal, state.stop_at = signum, time.monotonic()
            sdnotify.stopping(f"stopping ({_signame(signum)} forwarded to the engine)")
        if group[0]:
            _signal_group(group[0], signum)

    def watchdog_abort(signum, _frame):
        # systemd's WatchdogSignal: the engine is wedged, so it gets no grace; then abort as asked
        if group[0]:
            _signal_group(group[0], signal.SIGKILL)
        signal.signal(signum, signal.SIG_DFL)
        exit_like(-signum)
    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    previous[signal.SIGABRT] = signal.signal(signal.SIGABRT, watchdog_abort)

    sdnotify.status(f"{spec.loading}, starting {os.path.basename(spec.argv[0])}")
    try:
        child = subprocess.Popen(list(spec.argv), env=spec.env, stdin=subprocess.DEVNULL,
                                 start_new_session=True, preexec_fn=_die_with_parent)
    except OSError as exc:
        for s, h in previous.items():
            signal.signal(s, h)
        msg = f"{spec.name}: cannot start {spec.argv[0]!r}: {exc}"
        log.error(msg)
        sdnotify.status(msg)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    pgid = group[0] = child.pid  # start_new_session: the child leads its own group
    if state.stop_signal:        # a stop request raced the start
        _signal_group(pgid, state.stop_signal)
    log.info("%s: started %s (pid %d)", spec.name, " ".join(spec.argv), child.pid)

    t0 = time.monotonic()
    ready = False
    last_healthy = 0.0
    last_status = ""
    next_probe = t0
    next_extend = t0
    wd_period = sdnotify.watchdog_period()
    next_wd = t0
    serve_probe = min(t.serve_probe_s, wd_period / 2) if wd_period else t.serve_probe_s

    def say(text: str) -> None:
        nonlocal last_status
        if text != last_status:
            sdnotify.status(text)
            last_status = text

    try:
        while True:
            try:
                rc = child.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if state.stop_signal:
                if not state.killed and now - state.stop_at > t.stop_grace_s:
                    log.warning("%s: engine ignored %s for %.0f s; killing its process group", spec.name,
                                _signame(state.stop_signal), t.stop_grace_s)
                    _signal_group(pgid, signal.SIGKILL)
                    state.killed = True
                continue
            if now >= next_probe:
                p = probe(spec.health_url, t.probe_timeout_s)
                now = time.monotonic()
                next_probe = now + (serve_probe if ready else
                                    t.load_probe_s / 5 if now - t0 < 5 else t.load_probe_s)
                if p.ok:
                    last_healthy = now
                    if not ready:
                        ready = True
                        next_probe = next_wd = now + serve_probe
                        log.info("%s: healthy after %.1f s; READY", spec.name, now - t0)
                        sdnotify.ready(spec.serving)
                        last_status = spec.serving
                    else:
                        say(spec.serving)
                elif ready:
                    down_s = now - last_healthy
                    say(f"unhealthy for {down_s:.0f} s: {p.detail}"
                        + ("; watchdog pings stopped" if wd_period and down_s > wd_period else ""))
                else:
                    why = ""
                    if spec.needs_url:
                        q = probe(spec.needs_url, min(0.5, t.probe_timeout_s))
                        if not q.ok:
                            why = f"; the KV server is not answering ({spec.needs_url}: {q.detail}): the engine waits " \
                                  f"for it (lmcache.mp.mq_timeout), then exits and is restarted"
                    say(f"{spec.loading}, {now - t0:.0f} s ({p.detail}){why}")
            if not ready:
                elapsed = now - t0
                if elapsed > t.load_timeout_s:
                    msg = (f"{spec.name}: not healthy after {t.load_timeout_s:.0f} s ({spec.health_url}); "
                           f"stopping the engine")
                    log.error(msg)
                    sdnotify.status(msg)
                    state.stop_signal, state.stop_at = signal.SIGTERM, now
                    _signal_group(pgid, signal.SIGTERM)
                    try:
                        child.wait(timeout=t.stop_grace_s)
                    except subprocess.TimeoutExpired:
                        _signal_group(pgid, signal.SIGKILL)
                        child.wait()
                    return 1
                if now >= next_extend:
                    sdnotify.extend_timeout(t.extend_step_s)
                    next_extend = now + t.extend_step_s / 2
            elif wd_period and now >= next_wd:
                # ping only while /health answered 200 within the last period: a wedged engine stops the pings
                if now - last_healthy <= wd_period:
                    sdnotify.watchdog()
                next_wd = now + wd_period
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _reap_group(pgid)

    how = f"signal {_signame(-rc)}" if rc < 0 else f"status {rc}"
    if state.stop_signal:
        log.info("%s: engine stopped (%s)", spec.name, how)
    else:
        (log.info if rc == 0 else log.error)("%s: engine exited on its own (%s) after %.1f s",
                                             spec.name, how, time.monotonic() - t0)
        sdnotify.status(f"engine exited ({how})")
    return rc


def exit_like(rc: int) -> int:
    """End this process the way the engine ended: death by the same signal, else its exit code.

    systemd treats death by SIGTERM/SIGINT/SIGHUP as clean and by SIGKILL/SIGSEGV/SIGABRT as a failure;
    mirroring the signal keeps that judgement about the engine, not about the launcher.
    """
    if rc >= 0:
        return rc
    sig = -rc
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # re-raising SIGABRT/SIGSEGV: no core of *us*
    except (ImportError, ValueError, OSError):
        pass
    try:
        signal.signal(sig, signal.SIG_DFL)
    except (OSError, ValueError):   # SIGKILL/SIGSTOP cannot be handled, so they are already default
        pass
    os.kill(os.getpid(), sig)
    time.sleep(1)                      # not reached for fatal signals
    return 128 + sig
