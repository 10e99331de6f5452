"""``pdctl export prometheus``: the checked-in etc/ files are the generator's output for the default plan; the
dashboard has Grafana's shape; every expression parses and names metrics the live twin stack exposes; bad
input is a clear error."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "collector"))   # promcheck and the twin-stack fixture

from promcheck import check, expressions, selectors  # noqa: E402
from test_twin_stack import twin_stack  # noqa: E402,F401  (the fixture)

from appliance.views import monitoring  # noqa: E402
from appliance import metric_names as N  # noqa: E402
from appliance import yamlout  # noqa: E402
from appliance.plan.types import Plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# the default plan the checked-in files are generated from (8 soft-role workers on 8 H200s)
DEFAULT_PLAN = ["plan", "--gpus", "fake:8xH200", "--engine", "vllm", "--both", "8", "--json"]
AWAITED = frozenset({N.PROXY_MIGRATIONS + "_total"})     # the proxy adds it in issue 19 (stream migration)

DASHBOARD_SCHEMA = {
    "type": "object",
    "required": ["title", "uid", "schemaVersion", "panels", "templating", "time"],
    "properties": {
        "schemaVersion": {"type": "integer", "minimum": 36},
        "uid": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,40}$"},
        "templating": {"type": "object", "required": ["list"]},
        "panels": {"type": "array", "minItems": 10, "items": {
            "type": "object", "required": ["id", "type", "title", "gridPos", "targets", "datasource"],
            "properties": {
                "id": {"type": "integer"}, "type": {"enum": ["timeseries", "stat", "gauge"]},
                "title": {"type": "string", "minLength": 3}, "description": {"type": "string"},
                "gridPos": {"type": "object", "required": ["h", "w", "x", "y"], "properties": {
                    "h": {"type": "integer", "minimum": 1}, "w": {"type": "integer", "minimum": 1, "maximum": 24},
                    "x": {"type": "integer", "minimum": 0, "maximum": 23}, "y": {"type": "integer", "minimum": 0}}},
                "targets": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["refId", "expr"],
                    "properties": {"refId": {"type": "string"}, "expr": {"type": "string", "minLength": 5}}}}}}},
    },
}


def pdctl(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, **kw)


@pytest.fixture(scope="module")
def default_plan(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    r = pdctl(*DEFAULT_PLAN, "--config", str(out.parent / "absent.toml"))
    assert r.returncode == 0, r.stderr
    out.write_text(r.stdout)
    return out


def test_checked_in_files_are_the_export_of_the_default_plan(default_plan, tmp_path):
    r = pdctl("export", "prometheus", "--config", str(default_plan), "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    for name in (monitoring.YML_NAME, monitoring.DASHBOARD_NAME):
        assert (tmp_path / name).read_text() == (ROOT / "etc" / name).read_text(), \
            f"etc/{name} is stale: regenerate with `pdctl {' '.join(DEFAULT_PLAN)}` > plan.json; " \
            f"pdctl export prometheus --config plan.json --out etc"
    stdout = pdctl("export", "prometheus", "--config", str(default_plan))
    assert stdout.returncode == 0 and stdout.stdout == yamlout.dump(monitoring.scrape_config(
        Plan.from_json(json.loads(default_plan.read_text()))))


def test_scrape_config_targets_are_the_plans_ports_on_loopback(default_plan):
    import yaml
    plan = Plan.from_json(json.loads(default_plan.read_text()))
    doc = yaml.safe_load((ROOT / "etc" / monitoring.YML_NAME).read_text())
    jobs = {j["job_name"]: j for j in doc["scrape_configs"]}
    assert set(jobs) == {monitoring.JOB_PROXY, monitoring.JOB_ENGINES, monitoring.JOB_KV}
    targets = lambda j: [t for sc in jobs[j]["static_configs"] for t in sc["targets"]]  # noqa: E731
    assert targets(monitoring.JOB_PROXY) == [f"127.0.0.1:{plan.proxy.internal_port}"]
    assert targets(monitoring.JOB_KV) == [f"127.0.0.1:{plan.kv_server.http_port}"]
    assert targets(monitoring.JOB_ENGINES) == [f"127.0.0.1:{w.port}" for w in plan.workers]
    assert [sc["labels"]["worker"] for sc in jobs[monitoring.JOB_ENGINES]["static_configs"]] == \
        [w.instance for w in plan.workers]


def test_dashboard_has_grafanas_shape_and_every_expression_parses():
    doc = json.loads((ROOT / "etc" / monitoring.DASHBOARD_NAME).read_text())
    jsonschema.validate(doc, DASHBOARD_SCHEMA)
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in doc["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']} overlaps another"
        cells |= mine
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
        for t in p["targets"]:
            assert selectors(t["expr"]), t["expr"]                # parses, selects at least one metric
    with pytest.raises(ValueError):
        selectors("sum(rate(x[1m])")                              # the parser does reject bad PromQL


def test_bad_config_is_a_clear_error(tmp_path):
    r = pdctl("export", "prometheus", "--config", str(tmp_path / "nope.json"))
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "plan.json"
    bad.write_text("{}")
    r = pdctl("export", "prometheus", "--config", str(bad))
    assert r.returncode == 2 and "not a pdctl plan" in r.stderr


def test_every_expression_names_metrics_the_live_twin_stack_exposes(twin_stack):  # noqa: F811
    plan, _ = twin_stack
    for i in range(6):                                           # lazy families (decisions, legs) appear on use
        r = httpx.post(f"http://127.0.0.1:{plan.proxy.port}/v1/completions", timeout=30,
                       json={"model": "m", "max_tokens": 4, "prompt": "pdctl dashboard check " * (40 + 200 * i)})
        assert r.status_code == 200, r.text
    problems, jobs = check(plan, lambda url: httpx.get(url, timeout=5).text, AWAITED)
    assert not problems, "\n".join(problems)
    assert all(jobs.values()), jobs.keys()                       # every job's targets answered
    used = {name for _, e in expressions(plan) for name, _ in selectors(e)}
    assert used - AWAITED <= set().union(*jobs.values())
    missing = AWAITED - set().union(*jobs.values())
    print(f"dashboard: {len(used)} metric names checked against the twin stack; awaited: {sorted(missing)}")


def test_admission_is_on_the_board_goodput_beside_throughput():
    """Issue 28 point 6: verdicts by outcome and reason, the queue, and the goodput in the panel beside the
    requests (same row), its refusals in the same panel; refusals are not counted as errors."""
    from appliance import constants as C
    doc = json.loads((ROOT / "etc" / monitoring.DASHBOARD_NAME).read_text())
    by_title = {p["title"]: p for p in doc["panels"]}
    req, good = by_title["Requests, errors, migrations /s"], by_title["Goodput and refusals /s"]
    assert good["gridPos"]["y"] == req["gridPos"]["y"] and good["gridPos"]["x"] != req["gridPos"]["x"]
    used = {name for t in good["targets"] for name, _ in selectors(t["expr"])}
    assert {C.PROXY_GOOD + "_total", C.PROXY_ADMISSION + "_total"} <= used
    assert any('outcome="refuse"' in t["expr"] for t in good["targets"])
    verdicts = by_title["Admission verdicts /s by outcome and reason"]["targets"]
    assert verdicts[0]["legendFormat"] == "{{outcome}} {{reason}}" and "by (outcome, reason)" in verdicts[0]["expr"]
    assert selectors(by_title["Admission queue depth"]["targets"][0]["expr"]) == [(C.PROXY_QUEUE_DEPTH,
                                                                                   monitoring.JOB_PROXY)]
    waits = by_title["Admission queue wait p50 / p95"]
    assert waits["fieldConfig"]["defaults"]["unit"] == "s"
    assert [selectors(t["expr"])[0][0] for t in waits["targets"]] == [C.PROXY_QUEUE_WAIT + "_bucket"] * 2
    errors = next(t["expr"] for t in req["targets"] if t["legendFormat"] == "errors")
    assert "overloaded" in errors and 'outcome!~"' in errors
