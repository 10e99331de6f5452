"""`pdctl export llm-d`: Kubernetes objects from the same Plan, validated against the strict published schemas."""
from __future__ import annotations

import copy
import json

import pytest

from appliance.cli import main
from appliance.fleet.export_llmd import ExportOptions, build, validate, values_as_pods
from appliance.fleet.plan import FleetError
from appliance.inventory import detect
from appliance.model.profiles import resolve
from appliance.plan.planner import Overrides, Workload, make_plan

kv = pytest.importorskip("kubernetes_validate")
yaml = pytest.importorskip("yaml")


def vllm_plan(gpus="fake:3xA100-80GB", **ov):
    """A classic P/D plan (1 prefiller, the rest decoders) unless the test asks for other counts."""
    if not any(k in ov for k in ("prefill", "decode", "both")):
        ov["prefill"] = 1
    return make_plan(detect(gpus), resolve("deepseek-v2-lite"), Workload(), Overrides(engine="vllm", **ov))


def test_all_both_plan_exports_as_kv_both_decode_pods():
    plan = vllm_plan(both=3)
    built = build(plan, ExportOptions(namespace="llm", boxes=2))
    assert validate(all_docs(built, "llm"), kv.latest_version()) == []
    deps = {d["metadata"]["labels"]["llm-d.ai/role"]: d for d in built["pd-deployments.yaml"]}
    assert set(deps) == {"decode"} and deps["decode"]["spec"]["replicas"] == 6
    c = deps["decode"]["spec"]["template"]["spec"]["containers"][0]
    assert json.loads(_arg(c["args"], "--kv-transfer-config"))["kv_role"] == "kv_both"
    assert "affinity" not in deps["decode"]["spec"]["template"]["spec"]      # no prefiller to sit next to
    assert built["values-modelservice.yaml"]["prefill"] == {"create": False, "replicas": 0}
    assert any("kv_both" in r for r in built["reasons"])


def all_docs(built, ns="default"):
    return (built["lmcache-node.yaml"] + built["pd-deployments.yaml"]
            + values_as_pods(built["values-modelservice.yaml"], ns))


def _arg(args, name):
    return args[args.index(name) + 1]


@pytest.mark.parametrize("gpus,tp", [("fake:3xA100-80GB", None), ("fake:8xH200", 2)])
def test_export_validates_and_carries_the_plan(gpus, tp):
    plan = vllm_plan(gpus, **({"tp": tp} if tp else {}))
    built = build(plan, ExportOptions(namespace="llm", boxes=2))
    docs = all_docs(built, "llm")
    assert validate(docs, kv.latest_version()) == []
    assert validate(docs, "1.30.0") == []            # an older cluster too
    deps = {d["metadata"]["labels"]["llm-d.ai/role"]: d for d in built["pd-deployments.yaml"]}
    assert set(deps) == {"prefill", "decode"}
    for role, d in deps.items():
        ws = plan.by_role(role)
        assert d["spec"]["replicas"] == 2 * len(ws)
        c = d["spec"]["template"]["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == str(ws[0].tp)
        assert _arg(c["args"], "--tensor-parallel-size") == str(ws[0].tp)
        assert _arg(c["args"], "--host") == "0.0.0.0" and _arg(c["args"], "--port") == "8000"
        kvc = json.loads(_arg(c["args"], "--kv-transfer-config"))
        assert kvc["kv_role"] == ("kv_producer" if role == "prefill" else "kv_consumer")
        assert kvc["kv_connector_extra_config"]["lmcache.mp.host"] == \
            "tcp://deepseek-v2-lite-lmcache.llm.svc.cluster.local"
        # every other vLLM flag is the planner's, unchanged
        orig = list(ws[0].argv[2:])
        for flag in ("--max-model-len", "--block-size", "--gpu-memory-utilization", "--served-model-name"):
            assert _arg(c["args"], flag) == _arg(orig, flag)
        names = {e["name"] for e in c["env"]}
        assert "PYTHONHASHSEED" in names and "CUDA_VISIBLE_DEVICES" not in names
        assert d["spec"]["template"]["spec"]["hostIPC"] is True
    assert deps["decode"]["spec"]["template"]["spec"]["affinity"]["podAffinity"]
    ds, svc = built["lmcache-node.yaml"]
    assert ds["kind"] == "DaemonSet" and svc["spec"]["internalTrafficPolicy"] == "Local"
    largs = ds["spec"]["template"]["spec"]["containers"][0]["args"]
    assert _arg(largs, "--l1-size-gb") == f"{plan.kv_server.l1_size_gb:g}"
    vals = built["values-modelservice.yaml"]
    assert vals["decode"]["parallelism"]["tensor"] == plan.by_role("decode")[0].tp
    assert _arg(vals["decode"]["containers"][0]["args"], "--port") == str(vals["routing"]["proxy"]["targetPort"])


def test_validation_is_not_vacuous():
    built = build(vllm_plan(), ExportOptions())
    bad = copy.deepcopy(built["pd-deployments.yaml"][0])
    bad["spec"]["replicas"] = "two"
    bad2 = copy.deepcopy(built["lmcache-node.yaml"][1])
    bad2["spec"]["internalTrafficPolicyy"] = "Local"        # unknown field: strict schemas reject it
    errs = validate([bad, bad2], kv.latest_version())
    assert len(errs) == 2 and "replicas" in errs[0] and "internalTrafficPolicyy" in errs[1]


def test_twin_plan_is_refused_with_the_fix():
    plan = make_plan(detect("fake:3xA100-80GB"), resolve("deepseek-v2-lite"), Workload(), Overrides(engine="twin"))
    with pytest.raises(FleetError, match="--engine vllm"):
        build(plan, ExportOptions())
    with pytest.raises(FleetError, match="namespace"):
        build(vllm_plan(), ExportOptions(namespace="Bad_NS"))


def test_cli_writes_yaml_that_reads_back(tmp_path, capsys):
    plan = vllm_plan()
    pf = tmp_path / "plan.json"
    pf.write_text(json.dumps(plan.to_json()))
    out = tmp_path / "out"
    assert main(["export", "llm-d", "--plan", str(pf), "--out", str(out), "--boxes", "2"]) == 0
    assert "validated 6 objects" in capsys.readouterr().out
    built = build(plan, ExportOptions(boxes=2))
    assert list(yaml.safe_load_all((out / "pd-deployments.yaml").read_text())) == built["pd-deployments.yaml"]
    assert list(yaml.safe_load_all((out / "lmcache-node.yaml").read_text())) == built["lmcache-node.yaml"]
    assert yaml.safe_load((out / "values-modelservice.yaml").read_text()) == built["values-modelservice.yaml"]
    assert "Not validated" in (out / "README.md").read_text()
    assert main(["export", "llm-d", "--plan", str(tmp_path / "missing.json"), "--out", str(out)]) == 2
    assert "pdctl plan --engine vllm" in capsys.readouterr().err
    pf.write_text('{"mode": "x"}')
    assert main(["export", "llm-d", "--plan", str(pf), "--out", str(out)]) == 2
    assert "not a pdctl plan" in capsys.readouterr().err


def test_yaml_writer_round_trips_any_json_shape():
    """Every exported byte goes through the small YAML writer: it must read back exactly (PyYAML reads it)."""
    from hypothesis import example, given, settings, strategies as st

    from appliance.yamlout import dump, dump_all
    scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=12)
    keys = st.text(min_size=1, max_size=8) | st.sampled_from(["llm-d.ai/role", "yes", "null", "a b", "0x1"])
    tree = st.recursive(scalars, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(keys, ch, max_size=4),
                        max_leaves=20)

    @settings(max_examples=100, deadline=None)
    @given(st.dictionaries(keys, tree, max_size=5))
    @example({"A\n": None})            # found by this test: a key ending in a newline was written plain
    def check(doc):
        assert yaml.safe_load(dump(doc)) == doc
        assert list(yaml.safe_load_all(dump_all([doc, doc]))) == [doc, doc]
    check()
