"""``pdctl keys add|list|revoke|rotate``: edit the keys file safely and tell the running proxy.

Which file: ``--file``, else the installed plan's ``[proxy] keys_file`` (what the proxy reads), else
pdctl.toml's. Every edit takes a lock, writes a new file beside the old one (0600, owned by the pdctl user so
the proxy can read it), syncs it and renames it over the old one: a reader sees the old file or the new one,
never half of one, and two edits at once do not lose one. A new or rotated key is printed once, alone on
stdout (``KEY=$(pdctl keys add app)``); the file keeps only its SHA-256. Then ``systemctl reload pd-proxy``
(SIGHUP: the proxy re-reads the file; a revoked key fails from its next request, its open streams finish).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .. import constants as C
from ..errors import EXIT_BAD, EXIT_FAIL, CliError
from . import audit
from . import table as T


def _configured(config: Path) -> tuple:
    """(the installed plan's keys_file: what the proxy reads, pdctl.toml's: what the next apply installs)."""
    from ..plan.installed import load_plan, plan_path
    from ..settings.config import ConfigError, resolve
    try:
        planned = getattr(load_plan(config).proxy, "keys_file", "") if plan_path(config).exists() else ""
        return planned or "", resolve(config).get("proxy", "keys_file") or ""
    except ConfigError as e:
        raise CliError(str(e)) from None


def keys_path(args) -> tuple:
    """(path, in force: the proxy reads this file)."""
    planned, configured = _configured(Path(args.config))
    p = Path(args.file or planned or configured or "")
    if args.file or planned or configured:
        return p, bool(planned) and Path(planned) == p
    raise CliError(f"no keys file: set keys_file = \"{C.ETC_DIR / 'keys.toml'}\" under [proxy] in {args.config} "
                   "and run `sudo pdctl apply`, or pass --file PATH")


def read(path: Path) -> T.KeyTable:
    """The file's table ([] when it does not exist yet: the first ``add`` creates it)."""
    if not path.exists():
        return T.KeyTable((), str(path))
    try:
        return T.load(path)
    except T.KeysError as e:
        raise CliError(str(e)) from None


def write(path: Path, tbl: T.KeyTable) -> None:
    """Atomically replace ``path`` with ``tbl`` (0600, owned by the pdctl user where it exists and we are root)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        uid, gid = T.service_ids()
        if os.geteuid() == 0 and uid is not None:      # the proxy runs as pdctl: it must read the file
            os.fchown(fd, uid, gid if gid is not None else 0)
        os.write(fd, T.render(tbl).encode())
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class _Locked:
    """An exclusive lock beside the keys file for one read-modify-write."""

    def __init__(self, path: Path):
        self.lock = path.with_name(f".{path.name}.lock")

    def __enter__(self):
        self.lock.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def reload_proxy(in_force: bool, no_reload: bool) -> str:
    """Tell the running proxy (one line saying what happened)."""
    if not in_force:
        return ("note: this file is not the proxy's [proxy] keys_file: nothing reloaded (set keys_file to it and "
                "run `sudo pdctl apply`)")
    if no_reload:
        return "not reloaded (--no-reload): `systemctl reload pd-proxy` applies it"
    systemctl = shutil.which("systemctl")
    if systemctl is None:
        return "no systemctl here: the proxy reads the keys when it starts (or on SIGHUP)"
    try:
        active = subprocess.run([systemctl, "is-active", "--quiet", C.PROXY_UNIT], timeout=30).returncode == 0
        if not active:
            return f"{C.PROXY_UNIT} is not running: the keys apply when it starts"
        r = subprocess.run([systemctl, "reload", C.PROXY_UNIT], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise CliError(f"`systemctl reload {C.PROXY_UNIT}` did not return within 60 s: the file is written; check "
                       f"`journalctl -u {C.PROXY_UNIT}`", EXIT_FAIL) from None
    if r.returncode != 0:
        raise CliError(f"the file is written but `systemctl reload {C.PROXY_UNIT}` failed: "
                       f"{(r.stderr or r.stdout).strip()[:300]}; see `journalctl -u {C.PROXY_UNIT}`", EXIT_FAIL)
    return f"{C.PROXY_UNIT} reloaded: the change is in force"


def _limits(args) -> T.Limits:
    vals = {k: getattr(args, k) or 0 for k in T.LIMITS}
    bad = [k for k, v in vals.items() if v < 0]
    if bad:
        raise CliError(f"--{bad[0].replace('_', '-')} must be >= 0 (0 = no limit)", EXIT_BAD)
    return T.Limits(**vals)


def _describe(k: T.NamedKey) -> str:
    lim = ", ".join(f"{f.replace('_', ' ')} {getattr(k.limits, f)}" for f in T.LIMITS if getattr(k.limits, f))
    return f"{k.name}: class {k.klass}, scope {k.scope}, limits: {lim or 'none'}"


def operator() -> str:
    """Who runs this edit, for the audit: the sudo caller, else the user."""
    import pwd
    by = os.environ.get("SUDO_USER", "")
    if by:
        return by
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid {os.geteuid()}"


def _edit(args, change, action: str) -> int:
    path, in_force = keys_path(args)
    try:
        with _Locked(path):
            new, secret, what = change(read(path))
            write(path, new)
            audit.Trail().emit(audit.key_change(action, args.name, operator(), str(path)))
    except T.KeysError as e:
        raise CliError(str(e)) from None
    except PermissionError as e:
        raise CliError(f"{path}: {e.strerror}: run it as root (sudo pdctl keys ...)", EXIT_FAIL) from None
    if secret:
        print(secret)
        sys.stdout.flush()
        print(f"{what} (written to {path}). This is the only time the key is shown: the file keeps its SHA-256 "
              "only.", file=sys.stderr)
    else:
        print(f"{what} (written to {path}).", file=sys.stderr)
    print(reload_proxy(in_force, args.no_reload), file=sys.stderr)
    return 0


def cmd_add(args) -> int:
    def change(tbl):
        new, secret = T.added(tbl, args.name, args.klass, args.scope, _limits(args))
        return new, secret, "created key " + _describe(new.named(args.name))
    return _edit(args, change, "add")


def cmd_revoke(args) -> int:
    def change(tbl):
        new = T.revoked(tbl, args.name)
        return new, "", f"revoked key {args.name!r}: refused from its next request, its open streams finish"
    return _edit(args, change, "revoke")


def cmd_rotate(args) -> int:
    def change(tbl):
        new, secret = T.rotated(tbl, args.name)
        return new, secret, f"rotated key {args.name!r}: the old secret stops working, the new one is below"
    return _edit(args, change, "rotate")


def cmd_list(args) -> int:
    path, in_force = keys_path(args)
    tbl = read(path)
    if args.json:
        print(json.dumps([{"name": k.name, "class": k.klass, "scope": k.scope, "limits": {
            f: getattr(k.limits, f) for f in T.LIMITS}, "created": k.created, "revoked": k.revoked or None}
            for k in tbl.keys], indent=2))
        return 0
    if not tbl.keys:
        print(f"{path}: no keys yet (`pdctl keys add NAME`)")
        return 0
    rows = [("NAME", "CLASS", "SCOPE", "LIMITS", "CREATED", "STATE")]
    for k in tbl.keys:
        lim = " ".join(f"{f}={getattr(k.limits, f)}" for f in T.LIMITS if getattr(k.limits, f)) or "-"
        rows.append((k.name, k.klass, k.scope, lim, k.created or "-", f"revoked {k.revoked}" if k.revoked
                     else "active"))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip())
    if not in_force:
        print(f"note: {path} is not the proxy's [proxy] keys_file", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="named API keys for the public port: add, list, revoke, rotate")
    ks = p.add_subparsers(dest="keys_verb", required=True, metavar="ACTION")

    def common(q):
        q.add_argument("--config", default=str(C.CONFIG_PATH), help="pdctl.toml (its plan names the keys file)")
        q.add_argument("--file", help="edit this keys file instead of the configured [proxy] keys_file")
        q.add_argument("--no-reload", action="store_true", help="do not reload the proxy")
    a = ks.add_parser("add", help="create a key (printed once) with its class and limits")
    a.add_argument("name", help="who uses it: letters, digits, '.', '_', '-' (shown in the audit and metrics)")
    a.add_argument("--class", dest="klass", choices=T.CLASSES, default="interactive",
                   help="interactive (default) or batch: under overload a batch key yields")
    a.add_argument("--scope", choices=T.SCOPES, default="api", help="api (default) or metrics (reads /metrics only)")
    for k, what in T.LIMITS.items():
        a.add_argument(f"--{k.replace('_', '-')}", type=int, default=0, metavar="N", help=f"{what} (0 = no limit)")
    common(a)
    a.set_defaults(func=cmd_add)
    r = ks.add_parser("revoke", help="end a key: refused from its next request (its open streams finish)")
    r.add_argument("name")
    common(r)
    r.set_defaults(func=cmd_revoke)
    o = ks.add_parser("rotate", help="give a key a new secret (printed once); the old one stops working")
    o.add_argument("name")
    common(o)
    o.set_defaults(func=cmd_rotate)
    li = ks.add_parser("list", help="the keys, their classes, limits and state (never the keys themselves)")
    li.add_argument("--json", action="store_true")
    common(li)
    li.set_defaults(func=cmd_list)
