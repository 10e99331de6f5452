"""Tool calling, structured output and the Responses API store as plan keys: argv and env from the flag table,
the model registry's parser per family, `none` to turn it off, and cross-key errors naming file and key."""
from __future__ import annotations

import json

import pytest

from appliance.settings import config
from appliance.plan.engine_flags import ENGINE_VERSIONS
from appliance.inventory import detect
from appliance.model.profiles import REGISTRY, resolve
from appliance.plan.from_settings import plan_from_settings, planner_inputs
from appliance.plan.planner import Overrides, Workload, make_plan


def plan(model="llama-3.1-8b", engine="vllm", **kw):
    inv = detect("fake:8xH200" if engine == "vllm" else "none")
    counts = {} if engine == "vllm" else {"prefill": 1, "decode": 1}
    ov = Overrides(engine=engine, engine_venv="/opt/pdctl", l1_size_gb=8, choose_family=False, **counts, **kw)
    return make_plan(inv, resolve(model), Workload(), ov)


def flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.mark.parametrize("model,parser", [("llama-3.1-8b", "llama3_json"), ("llama-3.1-70b", "llama3_json"),
                                          ("qwen2.5-32b", "hermes"), ("deepseek-v3.2-nvfp4", "deepseek_v32"),
                                          ("deepseek-v2-lite", None)])
def test_registry_parser_per_family(model, parser):
    p = plan(model)
    for w in p.workers:
        assert flag(w.argv, "--tool-call-parser") == parser
        assert ("--enable-auto-tool-choice" in w.argv) == bool(parser)
    note = next(r for r in p.reasons if r.startswith("tool calling"))
    assert ("tool calling on" in note) == bool(parser), note


def test_every_registry_entry_says_where_its_parser_comes_from():
    for name, prof in REGISTRY.items():
        assert prof.tool_call_parser == "" or "parser" in prof.source, name


def test_plan_key_overrides_and_none_turns_off():
    p = plan("deepseek-v2-lite", tool_call_parser="hermes")
    assert all(flag(w.argv, "--tool-call-parser") == "hermes" for w in p.workers)
    assert any("[plan] tool_call_parser" in r for r in p.reasons)
    off = plan("llama-3.1-8b", tool_call_parser="none")
    assert not any("--tool-call-parser" in w.argv or "--enable-auto-tool-choice" in w.argv for w in off.workers)
    assert any('tool_call_parser = "none"' in r for r in off.reasons)


def test_structured_outputs_strictness_and_store_from_the_flag_table():
    p = plan("llama-3.1-8b", structured_outputs_backend="xgrammar", structured_outputs_compact=True,
             strict_tool_calls=False, responses_store=True)
    fl = ENGINE_VERSIONS[p.engine_version]
    for w in p.workers:
        assert json.loads(flag(w.argv, fl.structured_outputs_flag)) == {"backend": "xgrammar",
                                                                        "disable_any_whitespace": True}
        assert w.env[fl.strict_tool_env] == "0" and w.env[fl.responses_store_env] == "1"
    base = plan("llama-3.1-8b")
    for w in base.workers:                     # defaults: the engine's own behaviour, nothing added
        assert "--structured-outputs-config" not in w.argv
        assert "VLLM_ENFORCE_STRICT_TOOL_CALLING" not in w.env and "VLLM_ENABLE_RESPONSES_API_STORE" not in w.env


def test_cpu_engines_get_the_same_flags():
    p = plan("qwen2.5-32b", engine="vllm-cpu", structured_outputs_backend="guidance")
    assert p.engine_version == "0.32.0+cpu"
    for w in p.workers:
        assert flag(w.argv, "--tool-call-parser") == "hermes"
        assert json.loads(flag(w.argv, "--structured-outputs-config")) == {"backend": "guidance"}


def test_twin_engines_take_none_of_it():
    p = make_plan(detect("fake:2xH200"), resolve("llama-3.1-8b"), Workload(),
                  Overrides(engine="twin", prefill=1, decode=1, l1_size_gb=8, responses_store=True))
    for w in p.workers:
        assert "--tool-call-parser" not in w.argv and "VLLM_ENABLE_RESPONSES_API_STORE" not in w.env


def test_keys_flow_from_the_file(tmp_path):
    path = tmp_path / "pdctl.toml"
    path.write_text('schema_version = 1\n[install]\nmodel = "llama-3.1-8b"\ngpus = "fake:2xH200"\n'
                    '[plan]\nprefill = 1\ndecode = 1\ntool_call_parser = "hermes"\n'
                    'structured_outputs_backend = "xgrammar"\nstructured_outputs_compact = true\n'
                    'strict_tool_calls = false\nresponses_store = true\n[kv_server]\nl1_size_gb = 8.0\n')
    s = config.resolve(path, env={})
    _, ov = planner_inputs(s)
    assert (ov.tool_call_parser, ov.structured_outputs_backend, ov.structured_outputs_compact,
            ov.strict_tool_calls, ov.responses_store) == ("hermes", "xgrammar", True, False, True)
    p = plan_from_settings(s)
    assert all(flag(w.argv, "--tool-call-parser") == "hermes" for w in p.workers)


def test_compact_needs_a_backend_that_can(tmp_path):
    path = tmp_path / "pdctl.toml"
    path.write_text("schema_version = 1\n[plan]\nstructured_outputs_compact = true\n")
    with pytest.raises(config.ConfigError) as e:
        planner_inputs(config.resolve(path, env={}))
    assert str(path) in str(e.value) and "plan.structured_outputs_compact" in str(e.value)
    assert "xgrammar" in str(e.value)
