"""Restart workers one at a time (``[rollout] batch`` at a time), each drained first, so the box keeps serving.

Why: a GPU worker takes minutes to come back (weights, CUDA graphs, KV allocation); restarting every worker in
one ``systemctl restart`` leaves the box with none for those minutes. Per batch, in plain words:
1. **room**: the workers that stay must have room for the streams of those going out, and the proxy's
   admission queue must be empty (the box is not at its ceiling); else wait up to ``capacity_wait_s``, then stop
   (``--force`` goes on).
2. **drain**: the proxy sends them no new request or leg (control.py); their streams finish for up to
   ``drain_timeout_s``, then move to another worker (stream migration).
3. **restart** each unit, then wait for systemd's READY (the launcher's health check) with the launcher's
   STATUS= as progress, up to ``ready_timeout_s``; a unit that fails for good stops the rollout with its journal.
4. **canary**: the proxy puts a worker back only after one real request to it alone succeeded.
New workers (a plan that grew) start first and carry nothing yet, so they add room before any goes out.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .. import constants as C
from ..errors import CliError
from ..settings.schema import default as _d
from ..settings.schema import schema_fields
from ..wire.fetch import fetch_sync
from .host import info, systemctl, unit_state, warn
from .readiness import UnitFailed, failed_for_good

POLL_S = 0.5
HEARTBEAT_S = 5.0      # a progress line at least this often while a step waits
CANARY_TRIES_S = 30.0  # a restarted worker's canary is tried again for this long (an engine settling after READY)


ROLLOUT_KEYS = {"rollout": ("batch", "drain_timeout_s", "ready_timeout_s", "capacity_wait_s")}


@dataclass(frozen=True)
@schema_fields(ROLLOUT_KEYS)
class Rollout:
    """[rollout] batch, drain_timeout_s, ready_timeout_s, capacity_wait_s (fields from the schema) and --force."""
    force: bool = False               # go on when the others lack room after capacity_wait_s

    @classmethod
    def from_settings(cls, values: dict, force: bool = False) -> "Rollout":
        r = values.get("rollout", {})
        return cls(**{k: r[k] for k in ROLLOUT_KEYS["rollout"] if k in r}, force=force)


def room_for(status: dict, out: list, per_worker: int) -> str:
    """"" when the workers that stay can take the streams of ``out``, else why not (pure: the proxy's status in)."""
    backends = status.get("backends", [])
    leaving = [b for b in backends if b.get("name") in out]
    staying = [b for b in backends if b.get("name") not in out and b.get("state") == "closed" and not b.get("drained")]
    decoders = [b for b in staying if b.get("role") in ("decode", "both")]
    names = ", ".join(out)
    if not decoders:
        return f"no other worker can serve answers while {names} restart(s)"
    queued = int((status.get("admission") or {}).get("queue", 0))
    if queued:
        return f"{queued} requests wait in the proxy's admission queue: the box is at its ceiling"
    need = sum(int(b.get("streams", 0)) for b in leaving)
    room = sum(max(0, per_worker - int(b.get("inflight", 0))) for b in decoders)
    if need > room:
        return f"{names} stream(s) {need} answers; the other workers have room for {room}"
    return ""


def irreplaceable(status: dict, out: list) -> bool:
    """No other worker of the plan can serve answers at all (a one-decoder box): waiting for room is pointless."""
    return not any(b.get("role") in ("decode", "both") for b in status.get("backends", []) if b.get("name") not in out)


class Control:
    """The proxy's internal port as the rollout sees it: its status, and the drain with its control secret."""

    def __init__(self, port: int, token_file: Path = C.PROXY_CONTROL_TOKEN):
        self.port, self.token_file = port, Path(token_file)

    def status(self) -> dict | None:
        r = fetch_sync(C.loopback_url(self.port, C.BOX_STATUS_PATH), timeout_s=5.0)
        try:
            return json.loads(r.body) if r.status == 200 else None
        except ValueError:
            return None

    def usable(self) -> str:
        """"" when the proxy answers and its secret is readable, else why the rollout cannot drain."""
        if self.status() is None:
            return f"the proxy's internal port {self.port} does not answer"
        try:
            self.token_file.read_text()
        except OSError as exc:
            return f"cannot read the proxy's control secret {self.token_file} ({exc.strerror}; run as root)"
        return ""

    def _post(self, body: dict, timeout_s: float = 90.0) -> tuple:
        try:
            token = self.token_file.read_text().strip()
        except OSError as exc:
            return 0, {"error": {"message": f"{self.token_file}: {exc.strerror}"}}
        r = fetch_sync(C.loopback_url(self.port, C.PROXY_DRAIN_PATH), method="POST", body=json.dumps(body).encode(),
                       headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
                       timeout_s=timeout_s)
        try:
            return r.status, json.loads(r.body)
        except ValueError:
            return r.status, {"error": {"message": r.error or r.body[:200].decode(errors="replace")}}

    def drain(self, worker: str, migrate: bool = False) -> tuple:
        return self._post({"worker": worker, "drain": True, "migrate": migrate, "reason": "rollout"})

    def undrain(self, worker: str) -> tuple:
        return self._post({"worker": worker, "drain": False})


class WorkerFailed(CliError):
    """A worker that did not pass its canary: ``what`` happened; the advice depends on whether it is rolled back."""

    def __init__(self, what: str, advice: str):
        super().__init__(f"{what}. {advice}", 1)
        self.what = what


def invocation(unit: str) -> str:
    """systemd's InvocationID of the unit's current run ("" when it is not running): a restart changes it."""
    out = systemctl("show", unit, "-p", "InvocationID", "--value").stdout.strip()
    return out


def _error(answer: dict) -> str:
    return str((answer.get("error") or {}).get("message") or answer)


class State:
    """What a rollout is doing now, for `pdctl status` and the TUI (C.ROLLOUT_STATE; gone when it ends)."""

    def __init__(self, path: Path = C.ROLLOUT_STATE):
        self.path, self.t0 = Path(path), time.time()
        self.last: tuple = ()
        self.since = self.t0

    def set(self, step: str, workers: list, phase: str, detail: str = "") -> None:
        """``at``: when this step and phase began (a heartbeat line of the same phase keeps it)."""
        if (step, workers, phase) != self.last:
            self.last, self.since = (step, list(workers), phase), time.time()
        doc = {"pid": os.getpid(), "started": self.t0, "step": step, "workers": workers, "phase": phase,
               "detail": detail, "at": self.since}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".new")
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self.path)
        except OSError:
            pass           # the rollout goes on; only its display is missing

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


class Roll:
    """One rollout over a plan's workers."""

    def __init__(self, plan, ro: Rollout, ctl: Control | None = None, state: State | None = None):
        self.plan, self.ro = plan, ro
        self.ctl = ctl or Control(plan.proxy.internal_port)
        self.state = state or State()
        adm = getattr(plan.proxy, "admission", None) or {}
        self.per_worker = int(adm.get("max_num_seqs") or _d("plan", "max_num_seqs"))
        self.draining = True
        self.touched: list = []           # workers restarted (or being restarted) by this rollout, in order

    def say(self, step: str, names: list, phase: str, detail: str = "") -> None:
        info(f"{step} {', '.join(names)}: {phase}" + (f" ({detail})" if detail else ""))
        self.state.set(step, names, phase, detail)

    def run(self, workers: list, new: set) -> None:
        """Roll ``workers`` (WorkerPlans); those named in ``new`` only start. Raises CliError when one stops it."""
        fresh = [w for w in workers if w.instance in new]
        if fresh:
            info(f"starting {', '.join(w.unit for w in fresh)} (new in the plan: they carry nothing yet)")
            systemctl("start", "--no-block", *[w.unit for w in fresh])
            self._ready(fresh, "new")
        rest = [w for w in workers if w.instance not in new]
        why = self._control() if rest else ""
        if why:
            warn(f"{why}: restarting one batch at a time without draining (their streams move when they stop)")
            self.draining = False
        batches = [rest[i:i + max(1, self.ro.batch)] for i in range(0, len(rest), max(1, self.ro.batch))]
        try:
            for k, batch in enumerate(batches, 1):
                self._one(f"{k}/{len(batches)}", batch)
        finally:
            self.state.clear()

    def _control(self) -> str:
        """"" once the proxy answers with its secret readable (up to 30 s: it may be starting), else why not."""
        t0 = time.monotonic()
        while True:
            why = self.ctl.usable()
            if not why or time.monotonic() - t0 > 30.0:
                return why
            time.sleep(1.0)

    def _one(self, step: str, batch: list) -> None:
        names = [w.instance for w in batch]
        t0 = time.monotonic()
        if self.draining:
            self._room(step, names)
            for w in batch:
                code, ans = self.ctl.drain(w.instance)
                if code != 200:
                    raise CliError(f"the proxy would not drain {w.instance}: {_error(ans)}; nothing restarted", 1)
            self._drain(step, names)
        units = [w.unit for w in batch]
        self.touched += batch
        self.say(step, names, "restarting", " ".join(units))
        before = {u: invocation(u) for u in units}
        r = systemctl("restart", "--no-block", *units)
        if r.returncode != 0:
            raise CliError(f"systemctl restart {' '.join(units)} failed: {r.stderr.strip()}", 1)
        self._ready(batch, step, before)
        if self.draining:
            for w in batch:
                self._canary(step, w)
        info(f"{step} {', '.join(names)}: back in rotation after {time.monotonic() - t0:.0f} s")

    def _room(self, step: str, names: list) -> None:
        t0 = last = time.monotonic()
        while True:
            st = self.ctl.status()
            why = room_for(st, names, self.per_worker) if st is not None else "the proxy does not answer"
            if not why:
                return
            if st is not None and irreplaceable(st, names):
                warn(f"{step} {', '.join(names)}: no other worker of this plan can serve answers, so the box serves "
                     "none while it restarts (its open answers finish first); a plan with two or more decode-capable "
                     "workers rolls without a gap")
                return
            waited = time.monotonic() - t0
            if waited >= self.ro.capacity_wait_s:
                if self.ro.force:
                    warn(f"{step} {', '.join(names)}: {why}; going on anyway (--force)")
                    return
                raise CliError(f"{step} {', '.join(names)}: {why}, for {waited:.0f} s ([rollout] capacity_wait_s). "
                               "Nothing was taken out. Try again at a quieter time, or `--force` to go on (clients "
                               "may wait or be refused while it restarts)", 1)
            if time.monotonic() - last >= HEARTBEAT_S or waited == 0:
                self.say(step, names, "waiting for room", f"{why}; {waited:.0f} of {self.ro.capacity_wait_s:g} s")
                last = time.monotonic()
            time.sleep(1.0)

    def _drain(self, step: str, names: list) -> None:
        t0, last = time.monotonic(), 0.0
        while True:
            st = self.ctl.status() or {}
            open_ = {b["name"]: int(b.get("inflight", 0)) for b in st.get("backends", []) if b.get("name") in names}
            busy = sum(open_.values())
            waited = time.monotonic() - t0
            if busy == 0:
                self.say(step, names, "drained", f"after {waited:.1f} s")
                return
            if waited >= self.ro.drain_timeout_s:
                for n in names:
                    self.ctl.drain(n, migrate=True)
                self.say(step, names, "drain time-out", f"{busy} open legs move to other workers after "
                                                        f"{self.ro.drain_timeout_s:g} s ([rollout] drain_timeout_s)")
                return
            if time.monotonic() - last >= HEARTBEAT_S:
                self.say(step, names, "draining", f"{busy} legs still open; up to {self.ro.drain_timeout_s - waited:.0f}"
                                                  " s more, then they move")
                last = time.monotonic()
            time.sleep(POLL_S)

    def _ready(self, batch: list, step: str, before: dict | None = None) -> None:
        """Each unit (re)started and READY (a Type=notify worker is active only once the launcher saw it healthy);
        ``before``: each unit's InvocationID before its restart, so the old process still running is not taken
        for the new one."""
        units = {w.unit: w.instance for w in batch}
        before = before or {}
        restarts0 = {u: int(unit_state(u).get("NRestarts") or 0) for u in units}
        t0 = last = time.monotonic()
        while True:
            waiting = []
            for u in units:
                st = unit_state(u)
                why = failed_for_good(st, restarts0[u])
                if why:
                    raise UnitFailed(u, why)
                if before.get(u) and invocation(u) == before[u]:
                    waiting.append(f"{units[u]}: stopping the old engine")
                elif not (st.get("ActiveState") == "active" and st.get("SubState") == "running"):
                    waiting.append(f"{units[u]} {st.get('ActiveState')}: {st.get('StatusText') or 'no status yet'}")
            if not waiting:
                return
            waited = time.monotonic() - t0
            if waited >= self.ro.ready_timeout_s:
                u = next(iter(units))
                raise UnitFailed(u, f"not ready {waited:.0f} s after its restart ([rollout] ready_timeout_s); the "
                                    "rollout stopped here, the workers not reached yet run the old settings")
            if time.monotonic() - last >= HEARTBEAT_S:
                self.say(step, list(units.values()), "waiting for the engine", "; ".join(waiting))
                last = time.monotonic()
            time.sleep(POLL_S)

    def _canary(self, step: str, w) -> None:
        """Back into rotation once a real request to it alone succeeds; a few tries while its engine settles."""
        t0 = last = time.monotonic()
        self.say(step, [w.instance], "canary", "one real request to it alone")
        tries = 0
        while True:
            code, ans = self.ctl.undrain(w.instance)
            tries += 1
            if code == 200:
                return
            if time.monotonic() - t0 >= min(CANARY_TRIES_S, self.ro.ready_timeout_s):
                raise WorkerFailed(f"{step} {w.instance} failed its canary {tries} times in {CANARY_TRIES_S:g} s: "
                                   f"{_error(ans)}",
                                   f"It stays out of rotation (the others serve); `journalctl -u {w.unit}` says why, "
                                   "then `sudo pdctl apply` again")
            if time.monotonic() - last >= HEARTBEAT_S:
                self.say(step, [w.instance], "canary", f"try {tries} failed: {_error(ans)[:160]}; trying again")
                last = time.monotonic()
            time.sleep(2.0)
