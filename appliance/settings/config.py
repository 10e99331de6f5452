"""Operator settings: ``/etc/pdctl/pdctl.toml`` (tomllib in, tomli-w out) and the generated ``plan.json``.

Precedence: CLI flag > ``PDCTL_<SECTION>_<KEY>`` env > the file > defaults. Every error names the file
and the key, and says what type or value was expected; nothing is written on error. The keys, their defaults
and checks are the schema's (schema.py); ``etc/pdctl.toml`` is generated from it (``pdctl config template``).
"""
from __future__ import annotations

import ipaddress
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]
import tomli_w

from .. import constants as C
from .schema import FLAG_KEYS, SCHEMA, SCHEMA_VERSION, SO_BACKENDS, Key

_SAFE_PATH = re.compile(r"^/[A-Za-z0-9._/+@-]*$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class ConfigError(ValueError):
    """Bad settings: names the file and key (CLI exit code 2)."""


@dataclass(frozen=True)
class Settings:
    values: dict          # section -> key -> value
    sources: dict         # "section.key" -> "flag" | "env PDCTL_..." | "file PATH" | "default"
    path: Path

    def get(self, section: str, key: str) -> Any:
        return self.values[section][key]


def _err(path: Path | str, key: str, msg: str) -> ConfigError:
    return ConfigError(f"{path}: {key}: {msg}")


def _check(path: Path | str, dotted: str, spec: Key, value: Any) -> Any:
    t = spec.type
    c = spec.check
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if (isinstance(value, bool) and t is not bool) or not isinstance(value, t):
        raise _err(path, dotted, f"expected {t.__name__}, got {type(value).__name__} {value!r}")
    if t is float and not math.isfinite(value):
        raise _err(path, dotted, f"must be a finite number, got {value!r}")
    for item in (value if t is list else [value]):
        if isinstance(item, str) and _CONTROL.search(item):
            raise _err(path, dotted, f"{item!r} contains a control character (newline, tab, ...); values end up in "
                                     "unit files and argv, so they must be one plain line")
    if c == "host":
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise _err(path, dotted, f"{value!r} is not an IP address (e.g. 0.0.0.0 for all interfaces, "
                                     "127.0.0.1 to keep the proxy local)") from None
    if c == "model" and value.startswith(("/", ".")) and not Path(value).is_dir():
        raise _err(path, dotted, f"model directory {value!r} does not exist (give a registry name, e.g. "
                                 "deepseek-v2-lite, or an existing directory with config.json)")
    if dotted.endswith("gpu_indices") and not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise _err(path, dotted, f"expected a list of GPU indices (integers), got {value!r}")
    if dotted.endswith("extra_engine_args") and not all(isinstance(v, str) for v in value):
        raise _err(path, dotted, f"expected a list of strings (argv items), got {value!r}")
    if c == "port" and not 1 <= value <= 65535:
        raise _err(path, dotted, f"port {value} out of range 1..65535")
    if c in ("pos",) and value <= 0:
        raise _err(path, dotted, f"must be > 0, got {value}")
    if c == "nonneg" and value < 0:
        raise _err(path, dotted, f"must be >= 0, got {value}")
    if c in ("posf",) and value <= 0:
        raise _err(path, dotted, f"must be > 0, got {value}")
    if c == "nonnegf" and value < 0:
        raise _err(path, dotted, f"must be >= 0, got {value}")
    if c == "frac" and not 0.1 <= value <= 0.98:
        raise _err(path, dotted, f"must be between 0.1 and 0.98, got {value}")
    if c == "policy" and value not in ("adaptive", "pdctl", "round-robin"):
        raise _err(path, dotted, f"must be adaptive, pdctl or round-robin, got {value!r}")
    if c == "share" and not 0.0 <= value <= 1.0:
        raise _err(path, dotted, f"must be between 0 and 1, got {value}")
    if c == "engine" and value not in ("vllm", "vllm-cpu", "twin"):
        raise _err(path, dotted, f"must be vllm, vllm-cpu or twin, got {value!r}")
    if c == "revision" and not re.fullmatch(r"[A-Za-z0-9._/+-]+", value):
        raise _err(path, dotted, f"{value!r} is not a branch, tag or commit (letters, digits and ._/+- only)")
    if c == "admission_mode" and value not in ("slo", "queue", "off"):
        raise _err(path, dotted, f"must be slo, queue or off, got {value!r}")
    if c == "admission_status" and value not in (503, 429, 529):
        raise _err(path, dotted, f"must be 503, 429 or 529, got {value}")
    if c == "target" and not 0.2 <= value <= 1.0:
        raise _err(path, dotted, f"must be between 0.2 and 1.0 (a share of each SLO), got {value}")
    if c == "header?" and value and not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}", value):
        raise _err(path, dotted, f"{value!r} is not an HTTP header name (letters, digits and -_., at most 64; "
                                 "e.g. X-Session-Id, or '' for none)")
    if c == "prefill_failure" and value not in ("decode", "fail"):
        raise _err(path, dotted, f"must be decode or fail, got {value!r}")
    if c == "reap" and not (value == 0 or value >= 30):
        raise _err(path, dotted, f"must be 0 (never reap) or >= 30 (LMCache refuses less), got {value}")
    if c == "watchdog" and not (value == 0 or value >= 5):
        raise _err(path, dotted, f"must be 0 (no watchdog) or >= 5 s (the health probe behind each ping needs "
                                 f"time to answer), got {value}")
    if c == "conns" and not 1 <= value <= 1_000_000:
        raise _err(path, dotted, f"must be between 1 and 1000000 (pd-proxy's LimitNOFILE is 1048576), got {value}")
    if c == "bytes1k" and value < 1024:
        raise _err(path, dotted, f"must be >= 1024 bytes (less cannot hold a request line and its usual headers), "
                                 f"got {value}")
    if c == "parser" and not re.fullmatch(r"[a-z0-9_.-]*", value):
        raise _err(path, dotted, f"{value!r} is not a vLLM tool-call parser name (lower-case letters, digits and "
                                 "_.- such as hermes or llama3_json; 'none' = off)")
    if c == "so_backend" and value not in SO_BACKENDS:
        raise _err(path, dotted, f"must be one of {', '.join(b or repr(b) for b in SO_BACKENDS)}, got {value!r}")
    if c == "kvkind" and value not in ("", "lmcache", "twin"):
        raise _err(path, dotted, f"must be lmcache or twin, got {value!r}")
    if c in ("path", "path?") and not (c == "path?" and value == "") and not _SAFE_PATH.match(value):
        raise _err(path, dotted, f"{value!r} must be an absolute path of letters, digits and ._/+@- "
                                 "(no spaces or shell metacharacters)")
    return value


def _parse_env(raw: str, spec: Key, name: str) -> Any:
    try:
        if spec.type is int:
            return int(raw)
        if spec.type is float:
            return float(raw)
        if spec.type is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if spec.type is list and name.endswith("GPU_INDICES"):
            return [int(x) for x in raw.split(",") if x.strip()]
        if spec.type is list:
            return raw.split()
    except ValueError:
        raise ConfigError(f"environment {name}: expected {spec.type.__name__}, got {raw!r}") from None
    return raw


def read_file(path: Path) -> dict:
    """Parse and validate a settings file; returns the section dicts it sets (no defaults filled in)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from exc
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc}); fix the syntax or compare with etc/pdctl.toml") from exc
    ver = data.pop("schema_version", None)
    if ver is None:
        raise _err(path, "schema_version", f"missing; add `schema_version = {SCHEMA_VERSION}` at the top")
    if ver != SCHEMA_VERSION:
        raise _err(path, "schema_version", f"is {ver!r}; this pdctl reads {SCHEMA_VERSION}")
    out: dict = {}
    for section, body in data.items():
        if section not in SCHEMA:
            raise _err(path, section, f"unknown section; known: {', '.join(SCHEMA)}")
        if not isinstance(body, dict):
            raise _err(path, section, f"expected a [{section}] table, got {type(body).__name__}")
        for key, value in body.items():
            if key not in SCHEMA[section]:
                raise _err(path, f"{section}.{key}", f"unknown key; known in [{section}]: "
                                                     f"{', '.join(SCHEMA[section])}")
            out.setdefault(section, {})[key] = _check(path, f"{section}.{key}", SCHEMA[section][key], value)
    return out


def resolve(path: Path = C.CONFIG_PATH, flags: dict | None = None, env: dict | None = None,
            require_file: bool = False) -> Settings:
    """Merge defaults < file < PDCTL_* env < flags, recording where each value came from."""
    env = os.environ if env is None else env
    values = {s: {k: spec.default for k, spec in keys.items()} for s, keys in SCHEMA.items()}
    sources = {f"{s}.{k}": "default" for s, keys in SCHEMA.items() for k in keys}
    if path.exists():
        for s, body in read_file(path).items():
            for k, v in body.items():
                values[s][k] = v
                sources[f"{s}.{k}"] = f"file {path}"
    elif require_file:
        raise ConfigError(f"{path}: not found; run `sudo ./install.sh` (or `pdctl install`) first")
    for s, keys in SCHEMA.items():
        for k, spec in keys.items():
            name = f"{C.ENV_PREFIX}{s.upper()}_{k.upper()}"
            if name in env:
                values[s][k] = _check(f"environment {name}", f"{s}.{k}", spec, _parse_env(env[name], spec, name))
                sources[f"{s}.{k}"] = f"env {name}"
    for dest, value in (flags or {}).items():
        if value is None or dest not in FLAG_KEYS:
            continue
        s, k = FLAG_KEYS[dest]
        values[s][k] = _check(f"--{dest.replace('_', '-')}", f"{s}.{k}", SCHEMA[s][k], value)
        sources[f"{s}.{k}"] = "flag"
    return Settings(values=values, sources=sources, path=path)


def to_toml(settings: Settings) -> str:
    doc = {"schema_version": SCHEMA_VERSION, **settings.values}
    return "# pdctl settings; every key is documented in etc/pdctl.toml of the source tree.\n" + tomli_w.dumps(doc)


def atomic_write(path: Path, text: str, mode: int = 0o644) -> None:
    """Write via a temp file in the same directory + fsync + rename: readers see old or new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def template() -> str:
    """The documented default file (``etc/pdctl.toml``), generated from SCHEMA."""
    lines = ["# /etc/pdctl/pdctl.toml — pdctl settings. Every key, its default and what it does.",
             "# Precedence: CLI flag > PDCTL_<SECTION>_<KEY> environment > this file > defaults.",
             "# After editing: `sudo pdctl apply` re-plans and restarts only the units whose config changed",
             "# (when only the proxy's part of the plan changed, e.g. [listener] limits, it reloads the proxy:",
             "# no connection is dropped; its address, drain_timeout_s and watchdog_s restart it).",
             "", f"schema_version = {SCHEMA_VERSION}"]
    for section, keys in SCHEMA.items():
        lines += ["", f"[{section}]"]
        for k, spec in keys.items():
            lines.append(f"# {spec.doc}")
            lines.append(tomli_w.dumps({k: spec.default}).strip())
    return "\n".join(lines) + "\n"
