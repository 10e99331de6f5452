"""One owner per fact: paths, ports, URLs, env names and config defaults are written down once.

constants.py owns ports, paths, URLs and env names; the config schema (appliance/settings/schema.py) owns every settings
default. This test reads the source of appliance/ and tui/ (string and number literals, docstrings and comments
excluded) and names file:line wherever one of those facts is spelled out again instead of taken from its owner.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from appliance.settings.schema import SCHEMA

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("appliance", "tui")
CONSTANTS = "appliance/constants.py"
CONFIG = "appliance/settings/schema.py"

# text that must not appear inside a string literal outside its owner: (text, owner, what to use instead)
TEXTS = (
    ("http://127.0.0.1", CONSTANTS, "C.loopback_url(port, path) or a Plan property (http_url, telemetry_url)"),
    ("tcp://127.0.0.1", CONSTANTS, "C.loopback_zmq(port)"),
    ("etc/systemd/system", CONSTANTS, "C.SYSTEMD_DIR / C.SYSTEMD_REL"),
    ("var/cache/pdctl", CONSTANTS, "C.CACHE_DIR / C.MODEL_CACHE_DIR"),
    ("LMCACHE_REQUEST_TELEMETRY_", CONSTANTS, "C.ENV_TELEMETRY_TYPE / C.ENV_TELEMETRY_ENDPOINT"),
    ("/api/v1/telemetry", CONSTANTS, "C.TELEMETRY_PATH"),
    ("pd-kvcache.service", CONSTANTS, "C.KV_UNIT"),
    ("pd-proxy.service", CONSTANTS, "C.PROXY_UNIT"),
)
# a string literal that is exactly this value (prose that mentions it is fine)
EXACT = (
    ("/pdctl/status", CONSTANTS, "C.BOX_STATUS_PATH"),
    ("/etc/pdctl", CONSTANTS, "C.ETC_DIR"),
    ("/run/pdctl", CONSTANTS, "C.RUN_DIR"),
    ("/var/lib/pdctl", CONSTANTS, "C.STATE_DIR"),
)
# pdctl's default ports: as a number anywhere, or after a ':' inside a string
PORTS = {9000: "C.PROXY_PORT", 9001: "C.PROXY_INTERNAL_PORT", 8100: "C.PREFILL_PORT_BASE",
         8200: "C.DECODE_PORT_BASE", 8300: "C.AGGREGATED_PORT_BASE", 6000: "C.KV_ZMQ_PORT", 6080: "C.KV_HTTP_PORT"}
PORT_IN_TEXT = re.compile(r":(%s)(?!\d)" % "|".join(map(str, PORTS)))
NUMBER_PORTS = set(PORTS) - {6000}      # 6000 is also the seed's shared-prefix length (a number, not a port)
# the same number owned elsewhere for another reason: (file, number) -> why
ALLOWED = {
    ("appliance/fleet/export_llmd.py", 8200): "llm-d's routing sidecar targetPort (llm-d's convention, not ours)",
}

# schema defaults still written out in modules another change is restructuring (issue 22 item 3 moves these
# verbs); each must take config.default(...) once that lands: (file, key) -> where
PENDING: dict = {}   # (file, key) -> why it may wait; empty: every default has its one owner


def _docstrings(tree: ast.AST) -> set:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                ids.add(id(first.value))
    return ids


def _value(node):
    """The number or string a default expression stands for (constants and arithmetic on them), else a marker."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _value(node.operand)
        return -v if isinstance(v, (int, float)) and not isinstance(v, bool) else _NONE
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add, ast.Pow)):
        a, b = _value(node.left), _value(node.right)
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b)):
            return {ast.Mult: a * b, ast.Add: a + b, ast.Pow: a ** b}[type(node.op)]
    if isinstance(node, ast.IfExp):
        return (_value(node.body), _value(node.orelse))
    return _NONE


_NONE = object()


def _schema_defaults() -> dict:
    """key -> {default: 'section.key'} for defaults distinctive enough to recognise (not 0, '', booleans)."""
    out: dict = {}
    for section, keys in SCHEMA.items():
        for k, spec in keys.items():
            d = spec.default
            if isinstance(d, bool) or not isinstance(d, (int, float, str)) or d in (0, "", 1):
                continue
            out.setdefault(k, []).append((d, f"{section}.{k}"))
    return out


DEFAULTS = _schema_defaults()


def _same(value, default) -> bool:
    if isinstance(value, tuple):
        return any(_same(v, default) for v in value)
    if value is _NONE or isinstance(value, bool):
        return False
    if isinstance(default, str) or isinstance(value, str):
        return value == default
    return isinstance(value, (int, float)) and value == default


def _default_hits(tree: ast.AST):
    """(line, name, value) where a settings key is given its schema default as a literal."""
    def pairs():
        for node in ast.walk(tree):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                yield node.lineno, node.target.id, node.value
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        yield node.lineno, t.id, node.value
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                a = node.args
                pos = a.posonlyargs + a.args
                for arg, d in zip(pos[len(pos) - len(a.defaults):], a.defaults):
                    yield d.lineno, arg.arg, d
                for arg, d in zip(a.kwonlyargs, a.kw_defaults):
                    if d is not None:
                        yield d.lineno, arg.arg, d
            elif isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg:
                        yield kw.value.lineno, kw.arg, kw.value
                f = node.func
                if isinstance(f, ast.Attribute) and f.attr == "get" and len(node.args) == 2 \
                        and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                    yield node.lineno, node.args[0].value, node.args[1]
                if isinstance(f, ast.Attribute) and f.attr == "add_argument":
                    flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                             and a.value.startswith("--")]
                    for kw in node.keywords:
                        if kw.arg == "default":
                            for flag in flags:
                                yield node.lineno, flag[2:].replace("-", "_"), kw.value
            elif isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values):
                    if isinstance(k, ast.Constant) and isinstance(k.value, str):
                        yield v.lineno, k.value, v
    for line, name, node in pairs():
        for default, where in DEFAULTS.get(name, ()):
            if _same(_value(node), default):
                yield line, name, where


def violations(root: Path, dirs=SOURCE_DIRS) -> list:
    """Every place under ``root``'s ``dirs`` that spells out a fact owned elsewhere, as 'file:line: ...'."""
    out = []
    for d in dirs:
        for path in sorted((root / d).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(), rel)
            docs = _docstrings(tree)
            for node in ast.walk(tree):
                if not isinstance(node, ast.Constant) or id(node) in docs:
                    continue
                v = node.value
                if isinstance(v, str):
                    for text, owner, use in TEXTS:
                        if text in v and rel != owner:
                            out.append(f"{rel}:{node.lineno}: {text!r} belongs to {owner}; use {use}")
                    for text, owner, use in EXACT:
                        if v.strip("/") == text.strip("/") and rel != owner:
                            out.append(f"{rel}:{node.lineno}: {text!r} belongs to {owner}; use {use}")
                    for m in PORT_IN_TEXT.finditer(v):
                        port = int(m.group(1))
                        if rel != CONSTANTS and (rel, port) not in ALLOWED:
                            out.append(f"{rel}:{node.lineno}: port {port} in {v!r} belongs to {CONSTANTS}; "
                                       f"use {PORTS[port]}")
                elif isinstance(v, int) and not isinstance(v, bool) and v in NUMBER_PORTS:
                    if rel != CONSTANTS and (rel, v) not in ALLOWED:
                        out.append(f"{rel}:{node.lineno}: port {v} belongs to {CONSTANTS}; use {PORTS[v]}")
            if rel != CONFIG:
                for line, name, where in _default_hits(tree):
                    if (rel, name) in PENDING:
                        continue
                    out.append(f"{rel}:{line}: {name} = the schema default of {where} written again; use "
                               f"config.default({where.split('.')[0]!r}, {where.split('.')[1]!r})")
    return out


def test_every_fact_comes_from_its_owner():
    found = violations(ROOT)
    assert not found, "facts spelled out outside their owner:\n" + "\n".join(found)


@pytest.mark.parametrize("source, expect", [
    ('URL = "http://127.0.0.1:%d/ready" % 1\n', "'http://127.0.0.1' belongs to appliance/constants.py"),
    ('def f():\n    return f"tcp://127.0.0.1:{5}"\n', "'tcp://127.0.0.1' belongs"),
    ('D = "etc/systemd/system"\n', "'etc/systemd/system' belongs"),
    ('ENV = {"LMCACHE_REQUEST_TELEMETRY_TYPE": "fastapi"}\n', "'LMCACHE_REQUEST_TELEMETRY_' belongs"),
    ('ROUTE = ("GET", "/pdctl/status")\n', "'/pdctl/status' belongs"),
    ('PORT = 9001\n', "port 9001 belongs to appliance/constants.py; use C.PROXY_INTERNAL_PORT"),
    ('HELP = "e.g. 0.0.0.0:9000"\n', "port 9000 in"),
    ('class P:\n    kv_wait_s: float = 2.0\n', "kv_wait_s = the schema default of proxy.kv_wait_s"),
    ('x = plan.get("kv_wait_s", 2.0)\n', "proxy.kv_wait_s"),
    ('cfg = make(kv_wait_s=2.0 if tel else 0.0)\n', "proxy.kv_wait_s"),
    ('def g(max_body_bytes=32 * 1024 * 1024):\n    pass\n', "listener.max_body_bytes"),
    ('p.add_argument("--max-model-len", type=int, default=20000)\n', "workload.max_model_len"),
])
def test_a_planted_violation_is_named_with_file_and_line(tmp_path, source, expect):
    """The guard can fail: each kind of repeat, planted in a scratch tree, is reported at its file and line."""
    (tmp_path / "appliance").mkdir()
    (tmp_path / "appliance" / "planted.py").write_text('"""Docstrings may say http://127.0.0.1:9000."""\n' + source)
    found = violations(tmp_path, ("appliance",))
    assert len(found) == 1 and expect in found[0], found
    assert found[0].startswith("appliance/planted.py:"), found
    assert int(found[0].split(":")[1]) >= 2       # the line of the plant, not of the docstring


def test_other_values_and_prose_pass(tmp_path):
    (tmp_path / "appliance").mkdir()
    (tmp_path / "appliance" / "fine.py").write_text(
        '"""Mentions /etc/systemd/system and http://127.0.0.1:9000 in prose."""\n'
        '# a comment with /var/cache/pdctl\n'
        'HELP = "see /pdctl/status on the internal port"\n'
        'class P:\n    kv_wait_s: float = 0.5\n    timeout_s: float = 2.0\n')
    assert violations(tmp_path, ("appliance",)) == []


def test_the_carriers_of_settings_start_from_the_schema():
    """What travels from pdctl.toml to a running service defaults to the schema's value on every hop."""
    from appliance.settings.schema import default
    from appliance.policy.decide import Thresholds
    from appliance.plan.types import PROXY_TUNING, ProxyPlan
    from appliance.plan.planner import Workload
    from appliance.proxy.config import ProxyConfig
    from appliance.wire.server import Limits
    carried = [(ProxyPlan("h", 1, 2), PROXY_TUNING), (ProxyConfig(backends=()), PROXY_TUNING),
               (Limits(), {"listener": tuple(SCHEMA["listener"])}),
               (Workload(), {"workload": tuple(SCHEMA["workload"])}),
               (Thresholds(), {"proxy": ("aggregate_max_uncached", "split_max_prefill_backlog",
                                         "split_idle_max_running", "consumer_max_uncached",
                                         "warm_min_tokens", "warm_max_extra_load")}),
               (ProxyPlan("h", 1, 2), {"proxy": ("policy", "kv_wait_s", "pd_min_prompt_tokens", "public_status")}),
               (ProxyConfig(backends=()), {"proxy": ("host", "policy", "kv_wait_s", "pd_min_prompt_tokens")})]
    for obj, sections in carried:
        for section, keys in sections.items():
            for k in keys:
                assert getattr(obj, k) == default(section, k), (type(obj).__name__, k)
