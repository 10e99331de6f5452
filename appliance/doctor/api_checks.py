"""Checks of the OpenAI surface the workers serve: tool calling (a parser must be set when clients send tools)."""
from __future__ import annotations

from typing import Any

from appliance.inventory import is_na

from .argv import flag, running_argv
from .config_checks import _facts_by_instance
from .probe import Facts
from .result import NA_, OK, WARN, Check

_FIX = ("set [plan] tool_call_parser in pdctl.toml to this model's vLLM parser (hermes for Qwen2.5, llama3_json for "
        "Llama 3.1, deepseek_v3 / deepseek_v31 / deepseek_v32 for DeepSeek V3 / V3.1 / V3.2; `vllm serve --help` "
        "lists them) and `sudo pdctl apply`")


def check_tool_calling(plan: Any, f: Facts) -> Check:
    """WARN when clients ask for tools and a worker runs without ``--tool-call-parser`` (vLLM then answers 400 to
    tool_choice auto, required and named), or when workers run different parsers."""
    name = "tool calling"
    if plan.engine == "twin":
        return Check(name, NA_, "twin engines: simulated, no tool calling")
    by = _facts_by_instance(f)
    parsers = {}
    for w in plan.workers:
        argv, _ = running_argv(w, by.get(w.instance))
        parsers[w.instance] = flag(argv, "--tool-call-parser") if "--enable-auto-tool-choice" in argv else None
    st = f.proxy_status
    asked = (st.get("features") or {}).get("tools", 0) if isinstance(st, dict) else None
    seen = ("proxy status unreadable: " + st.reason.split(": ", 1)[-1]) if is_na(st) else \
        f"{asked} request(s) with tools since the proxy started"
    off = [i for i, p in parsers.items() if not p]
    kinds = {p for p in parsers.values() if p}
    if off and asked:
        return Check(name, WARN, f"{seen}, but {', '.join(off)} run(s) without --tool-call-parser: vLLM answers "
                                 "400 to tool_choice auto, required and named there", _FIX)
    if len(kinds) > 1 or (off and kinds):
        desc = ", ".join(f"{i}: {p or 'off'}" for i, p in parsers.items())
        return Check(name, WARN, f"workers differ in tool-call parser ({desc}): the same request parses "
                                 f"differently depending on the worker", f"{_FIX}; then every worker runs the same")
    if off:
        return Check(name, OK, f"tool calling off (no --tool-call-parser); {seen}")
    return Check(name, OK, f"--tool-call-parser {kinds.pop()} on every worker; {seen}")
