"""The keys file (``[proxy] keys_file``): one ``[[key]]`` entry per caller of the public port.

Each entry has a ``name`` (what the audit, the metrics and ``pdctl keys`` call it), the key's SHA-256 digest
(``sha256``; or the key itself as ``key`` for a file written by hand, so the file need not hold secrets in
clear), a ``class`` (``interactive`` or ``batch``: who yields under overload), a ``scope`` (``api``: the OpenAI
routes; ``metrics``: a read-only scrape key for ``/metrics``), optional limits (0 = none) and its dates.
A revoked key stays in the file (``revoked = <date>``) so its next request is told so, not "wrong key".

The file may be read by root and the pdctl user only (0600, owned by root or pdctl; 0640 with group pdctl):
a key file anyone can read is refused, naming the file and the ``chmod``/``chown`` that fixes it. Every error
names the file, the entry and the fix; nothing here writes (cli.py does, atomically).
"""
from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import stat
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]
import tomli_w

CLASSES = ("interactive", "batch")      # interactive first: under overload a batch key yields (admission)
# each class's weight in the box's capacity under overload: an interactive key is entitled to 4 streams for
# every one of a batch key while both ask (sharing.WaitQueue); the queue also orders a batch key's requests behind
# every interactive one of the same standing (guard.queue_priority)
CLASS_WEIGHTS = {"interactive": 4.0, "batch": 1.0}
SCOPES = ("api", "metrics")             # metrics: GET /metrics only (a scrape key that cannot generate)
LIMITS = {"rpm": "requests per minute", "tpm": "prompt + completion tokens per minute",
          "max_streams": "requests in flight at once", "daily_tokens": "prompt + completion tokens per UTC day"}
FIELDS = ("name", "sha256", "key", "class", "scope", *LIMITS, "created", "revoked")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
KEY_PREFIX = "sk-pd-"
MIN_KEY_CHARS = 16                      # a hand-written key shorter than this is refused (guessable)
HEADER = ("# pdctl API keys ([proxy] keys_file): edited by `pdctl keys add|list|revoke|rotate`, which keep only\n"
          "# each key's SHA-256. Readable by root and the pdctl user only (0600). docs/security.md explains it.\n")


class KeysError(ValueError):
    """A keys file the proxy must not run with: says file, entry and fix."""


@dataclass(frozen=True)
class Limits:
    rpm: int = 0            # requests per minute (0 = no limit)
    tpm: int = 0            # prompt + completion tokens per minute
    max_streams: int = 0    # requests in flight at once
    daily_tokens: int = 0   # prompt + completion tokens per UTC day

    def any(self) -> bool:
        return any(getattr(self, k) for k in LIMITS)


@dataclass(frozen=True)
class NamedKey:
    name: str
    sha256: str                     # hex digest of the key
    klass: str = "interactive"
    scope: str = "api"
    limits: Limits = Limits()
    created: str = ""
    revoked: str = ""               # when it was revoked ("" = active)

    @property
    def active(self) -> bool:
        return not self.revoked


@dataclass(frozen=True)
class KeyTable:
    keys: tuple = ()                # NamedKey, in file order
    source: str = ""                # where it came from (for messages)
    _by_digest: dict = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_digest", {k.sha256: k for k in self.keys})

    def match(self, presented: str) -> NamedKey | None:
        """The entry whose digest is the presented key's (revoked ones too: the caller says "revoked")."""
        if not presented:
            return None
        d = digest(presented)
        k = self._by_digest.get(d)
        return k if k is not None and hmac.compare_digest(k.sha256, d) else None

    def named(self, name: str) -> NamedKey | None:
        return next((k for k in self.keys if k.name == name), None)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def new_secret() -> str:
    """A fresh key: 256 random bits, URL-safe, recognisable by its prefix (secret scanners, logs)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def now_utc() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- reading ----------------------------------------------------------------------------------------------
def _entry(raw: object, i: int, where: str) -> NamedKey:
    label = f"{where}: [[key]] #{i + 1}"
    if not isinstance(raw, dict):
        raise KeysError(f"{label}: not a table; write each key as a [[key]] section")
    name = raw.get("name")
    if isinstance(name, str):
        label += f" ({name!r})"
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise KeysError(f"{label}: unknown field(s) {', '.join(unknown)}; known: {', '.join(FIELDS)}")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise KeysError(f"{label}: name must be 1-64 letters, digits, '.', '_' or '-' (starting with a letter or "
                        f"digit), got {name!r}")
    has_hash, has_key = "sha256" in raw, "key" in raw
    if has_hash == has_key:
        raise KeysError(f"{label}: give exactly one of sha256 (the key's SHA-256, hex) or key (the key itself); "
                        "`pdctl keys add NAME` writes a new entry for you")
    if has_hash:
        h = raw["sha256"]
        if not (isinstance(h, str) and re.fullmatch(r"[0-9a-fA-F]{64}", h)):
            raise KeysError(f"{label}: sha256 must be 64 hex digits (`printf %s KEY | sha256sum`), got {h!r}")
        h = h.lower()
    else:
        k = raw["key"]
        if not isinstance(k, str) or len(k.strip()) < MIN_KEY_CHARS or k != k.strip() or not k.isprintable():
            raise KeysError(f"{label}: key must be at least {MIN_KEY_CHARS} printable characters without spaces "
                            "at either end (a short key can be guessed); `pdctl keys add NAME` makes one")
        h = digest(k)
    klass = raw.get("class", "interactive")
    if klass not in CLASSES:
        raise KeysError(f"{label}: class must be one of {', '.join(CLASSES)}, got {klass!r}")
    scope = raw.get("scope", "api")
    if scope not in SCOPES:
        raise KeysError(f"{label}: scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    lim = {}
    for k, what in LIMITS.items():
        v = raw.get(k, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise KeysError(f"{label}: {k} ({what}) must be a whole number >= 0 (0 = no limit), got {v!r}")
        lim[k] = v
    dates = {}
    for k in ("created", "revoked"):
        v = raw.get(k, "")
        if isinstance(v, datetime):
            v = v.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if v.tzinfo else v.isoformat()
        if not isinstance(v, str):
            raise KeysError(f"{label}: {k} must be a date string, got {v!r}")
        dates[k] = v
    return NamedKey(name, h, klass, scope, Limits(**lim), dates["created"], dates["revoked"])


def parse(text: str, where: str) -> KeyTable:
    """A KeyTable from the file's text; ``where`` names the file in errors."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise KeysError(f"{where}: not valid TOML: {e}") from None
    extra = sorted(set(doc) - {"key"})
    if extra:
        raise KeysError(f"{where}: unknown section(s) {', '.join(extra)}; the file holds only [[key]] entries")
    raw = doc.get("key", [])
    if not isinstance(raw, list):
        raise KeysError(f"{where}: 'key' must be [[key]] sections (an array of tables), not a single [key] table")
    keys = [_entry(r, i, where) for i, r in enumerate(raw)]
    seen: dict = {}
    for i, k in enumerate(keys):
        if k.name in seen:
            raise KeysError(f"{where}: [[key]] #{i + 1}: name {k.name!r} is used by #{seen[k.name] + 1} too; "
                            "names must be unique (the audit and the limits go by name)")
        seen[k.name] = i
    digests: dict = {}
    for k in keys:
        if k.sha256 in digests:
            raise KeysError(f"{where}: keys {digests[k.sha256]!r} and {k.name!r} are the same key; give each caller "
                            f"its own (`pdctl keys rotate {k.name}`)")
        digests[k.sha256] = k.name
    return KeyTable(tuple(keys), where)


def permission_problem(path: Path, st, allowed_uids: set, allowed_gid: int | None) -> str | None:
    """Why this file's owner or mode lets others read or change the keys (None: it does not)."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in allowed_uids:
        return (f"{path}: owned by uid {st.st_uid}: the keys file must belong to root or the pdctl user "
                f"(`chown root:pdctl {path}`)")
    if mode & 0o007:
        return f"{path}: mode {mode:04o} lets every user read it: `chmod 600 {path}`"
    if mode & 0o070 and (mode & 0o020 or allowed_gid is None or st.st_gid != allowed_gid):
        return f"{path}: mode {mode:04o} lets group {st.st_gid} read or change it: `chmod 600 {path}`"
    return None


def service_ids() -> tuple:
    """(the pdctl user's uid, its group's gid), each None where it does not exist."""
    import grp
    import pwd
    from .. import constants as C
    uid = gid = None
    try:
        uid = pwd.getpwnam(C.SERVICE_USER).pw_uid
    except KeyError:
        pass
    try:
        gid = grp.getgrnam(C.SERVICE_USER).gr_gid
    except KeyError:
        pass
    return uid, gid


def load(path: Path | str) -> KeyTable:
    """The keys file, refused when it is missing, readable by others, or has a bad entry."""
    p = Path(path)
    try:
        st = p.stat()
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KeysError(f"{p}: [proxy] keys_file does not exist: create it with `pdctl keys add NAME`, or set "
                        "keys_file = \"\" to turn named keys off") from None
    except OSError as e:
        raise KeysError(f"{p}: cannot read the keys file: {e.strerror or e} (it must be readable by the pdctl "
                        f"user: `chown pdctl {p}; chmod 600 {p}`)") from None
    except UnicodeDecodeError:
        raise KeysError(f"{p}: not UTF-8 text") from None
    uid, gid = service_ids()
    why = permission_problem(p, st, {0} | ({uid} if uid is not None else set()), gid)
    if why:
        raise KeysError(why)
    return parse(text, str(p))


# ---- writing (the text; cli.py writes it) --------------------------------------------------------------------
def render(table: KeyTable) -> str:
    entries = []
    for k in table.keys:
        e = {"name": k.name, "sha256": k.sha256, "class": k.klass, "scope": k.scope}
        e.update({f: getattr(k.limits, f) for f in LIMITS if getattr(k.limits, f)})
        e.update({f: getattr(k, f) for f in ("created", "revoked") if getattr(k, f)})
        entries.append(e)
    return HEADER + ("\n" + tomli_w.dumps({"key": entries}) if entries else "")


def added(table: KeyTable, name: str, klass: str = "interactive", scope: str = "api",
          limits: Limits = Limits()) -> tuple:
    """(new table, the new key in clear): a new entry; refused when the name is taken."""
    if not NAME_RE.match(name or ""):
        raise KeysError(f"key name {name!r}: use 1-64 letters, digits, '.', '_' or '-' (starting with a letter "
                        "or digit)")
    if table.named(name):
        raise KeysError(f"{table.source}: a key named {name!r} exists already: `pdctl keys rotate {name}` gives it "
                        f"a new secret, `pdctl keys revoke {name}` ends it")
    if klass not in CLASSES or scope not in SCOPES:
        raise KeysError(f"class must be one of {', '.join(CLASSES)} and scope one of {', '.join(SCOPES)}")
    secret = new_secret()
    k = NamedKey(name, digest(secret), klass, scope, limits, now_utc())
    return replace(table, keys=table.keys + (k,)), secret


def _named_or_fail(table: KeyTable, name: str) -> NamedKey:
    k = table.named(name)
    if k is None:
        have = ", ".join(x.name for x in table.keys) or "none"
        raise KeysError(f"{table.source}: no key named {name!r} (keys: {have}); `pdctl keys list` shows them")
    return k


def revoked(table: KeyTable, name: str) -> KeyTable:
    k = _named_or_fail(table, name)
    if not k.active:
        raise KeysError(f"{table.source}: key {name!r} was revoked already ({k.revoked})")
    keys = tuple(replace(x, revoked=now_utc()) if x.name == name else x for x in table.keys)
    return replace(table, keys=keys)


def rotated(table: KeyTable, name: str) -> tuple:
    """(new table, the new key in clear): the same name, class and limits with a new secret (the old one stops
    working at once); a revoked key comes back active."""
    _named_or_fail(table, name)
    secret = new_secret()
    keys = tuple(replace(x, sha256=digest(secret), created=now_utc(), revoked="") if x.name == name else x
                 for x in table.keys)
    return replace(table, keys=keys), secret
