"""A forced move under a third-party tool (issue 32, "external (LMCache) hits after a forced move"): while aiperf's
user-centric conversations run through pdctl's proxy, the worker that holds most of them (the most prompt tokens
served since the tool started) is drained through the proxy's control route (``POST /pdctl/workers/drain`` on the
internal loopback port with the control secret, appliance/proxy/control.py: no new request goes to it, what it
streams goes on), ``--drain-at`` seconds into the tool's run. Every later turn of a conversation it served lands on
another worker, whose own GPU prefix cache does not hold that history: the engines' counters say whether the
history came from LMCache (``vllm:external_prefix_cache_hits_total`` grows there) or was computed again
(``vllm:prompt_tokens_by_source_total{source="local_compute"}``).

Read before the tool, at the drain and after it, per worker: prompt tokens, local prefix-cache hits, external
(LMCache) hits, computed tokens, finished requests; the proxy's decisions by reason. The tool's own records give
the turns sent after the drain and the tokens they wrote anew (a first turn: its prompt less the shared system
prompt; turn k: its prompt less turn k-1's, i.e. the answer that came back + the new message + role words), so
"computed after the drain" is compared with what a perfect cache would compute. Requests in flight at the drain
straddle the two phases (their prompt counts in the phase where the engine prefilled it). The worker goes back into
rotation (its canary) when the tool is done.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import chat_sessions as CS

from appliance import constants as C

METRICS = {"prompt": C.VLLM_PROMPT_TOKENS, "local_hits": C.VLLM_PREFIX_HITS, "ext_hits": C.VLLM_EXT_PREFIX_HITS,
           "ext_queries": C.VLLM_EXT_PREFIX_QUERIES}


def _get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _sum(text: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.split("{", 1)[0].split(" ", 1)[0] in (name, name + "_total") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Box:
    """What the drain needs of a stack: its workers (the proxy's labels -> engine URLs), the proxy's internal URL
    and the file holding its control secret."""
    workers: dict
    internal_url: str
    token_path: Path

    @classmethod
    def twin(cls, stack) -> "Box":
        return cls({w.instance: w.url() for w in stack.plan.workers},
                   C.loopback_url(stack.plan.proxy.internal_port), stack.control_token_path)

    def status(self) -> dict:
        return json.loads(_get(self.internal_url + C.BOX_STATUS_PATH))

    def idle(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.status().get("inflight", 0):
            time.sleep(0.5)


def counters(box: Box) -> dict:
    out: dict = {"t": time.time(), "workers": {}}
    for name, url in box.workers.items():
        t = _get(url + "/metrics")
        row = {k: _sum(t, metric) for k, metric in METRICS.items()}
        row["computed"] = _sum(t, C.VLLM_PROMPT_BY_SOURCE, 'source="local_compute"')
        row["requests"] = _sum(t, "vllm:request_success_total")
        out["workers"][name] = row
    out["decisions"] = box.status().get("decisions", {})
    return out


def control(box: Box, worker: str, drain: bool) -> dict:
    token = box.token_path.read_text().strip()
    body = json.dumps({"worker": worker, "drain": drain, "reason": "chat-sessions forced move"}).encode()
    req = urllib.request.Request(box.internal_url + C.PROXY_DRAIN_PATH, body,
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def delta(after: dict, before: dict) -> dict:
    if isinstance(after, dict):
        return {k: delta(v, before.get(k, 0) if isinstance(before, dict) else 0) for k, v in after.items()}
    return after - before if isinstance(after, (int, float)) else after


def routed(c: dict) -> float:
    """Turns the proxy decided (its decisions by reason, all groups)."""
    return sum(v for g in c["decisions"].values() if isinstance(g, dict) for v in g.values())


class Drainer:
    """Watches the proxy; once ``after_turns`` turns were routed since ``c0`` (or ``at_s`` seconds passed, when
    given), reads the counters and drains the worker that served most prompt tokens since ``c0`` (the turns; its
    finished requests also count the proxy's 1-token readiness canaries)."""

    def __init__(self, box: Box, c0: dict, at_s: float, after_turns: int):
        self.box, self.c0, self.at_s, self.after_turns = box, c0, at_s, after_turns
        self.at: dict | None = None
        self.worker = ""
        self.answer: dict = {}
        self.error = ""
        self.why = ""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.watch, daemon=True)

    def watch(self) -> None:
        t0 = time.monotonic()
        while not self.stop.wait(0.25):
            try:
                n = routed(counters(self.box)) - routed(self.c0) if self.after_turns else 0
            except OSError:
                continue
            if self.after_turns and n >= self.after_turns:
                self.why = f"after {n:.0f} turns routed"
            elif self.at_s and time.monotonic() - t0 >= self.at_s:
                self.why = f"{time.monotonic() - t0:.0f} s into the run"
            else:
                continue
            self.why += f" ({time.monotonic() - t0:.1f} s in)"
            return self.fire()

    def fire(self) -> None:
        try:
            self.at = counters(self.box)
            d = delta(self.at, self.c0)["workers"]
            self.worker = max(d, key=lambda w: d[w]["prompt"])     # requests would count the proxy's canaries
            self.answer = control(self.box, self.worker, True)
            CS.log(f"drained {self.worker} {self.why}: {self.answer}")
        except Exception as exc:  # noqa: BLE001 - recorded in the report, the tool runs on
            self.error = f"{type(exc).__name__}: {exc}"
            CS.log(f"drain failed: {self.error}")


def new_tokens(records: list, system_len: int) -> list:
    """Each record with ``new``: what it wrote anew (first turn: prompt - system prompt; turn k: prompt - turn
    k-1's prompt)."""
    by_conv: dict = {}
    for x in records:
        by_conv.setdefault(x["conv"], {})[x["turn"]] = x
    for turns in by_conv.values():
        for k, x in turns.items():
            prev = turns.get(k - 1)
            x["new"] = x["prompt"] - system_len if k == 1 else (x["prompt"] - prev["prompt"] if prev else None)
    return records


def run(target, box: Box, a, tok: Path, qps: float, out: Path, commands: list) -> dict:
    """aiperf against ``target`` (a proxy_url and plan.served_model_name) with the drain; ``box``: its workers."""
    out.mkdir(parents=True, exist_ok=True)
    c0 = counters(box)
    after = a.drain_after or (0 if a.drain_at else a.users + a.turns_total // 2)   # default: half its turns
    dr = Drainer(box, c0, a.drain_at, after)
    records: list = []
    dr.thread.start()
    try:
        row = CS.aiperf(target, a, tok, qps, out, commands, records=records)
    finally:
        dr.stop.set()
        dr.thread.join()
    box.idle()
    time.sleep(2.0)                      # the last chunk's store ends just after the answer
    c2 = counters(box)
    back = control(box, dr.worker, False) if dr.worker else {}
    t_d = dr.at["t"] if dr.at else None
    new_tokens(records, CS.PROF.system_len)
    warm_convs = {x["conv"] for x in records if t_d and x["start"] < t_d}
    after = [x for x in records if t_d and x["start"] >= t_d]
    moved = [x for x in after if x["conv"] in warm_convs and x["turn"] > 1]
    first_moved: dict = {}
    for x in sorted(moved, key=lambda r: r["start"]):
        first_moved.setdefault(x["conv"], x)
    phases = {"before_drain": delta(dr.at, c0) if dr.at else None, "after_drain": delta(c2, dr.at) if dr.at else None}
    rep = {"drain_at_s": a.drain_at, "drain_after_turns": after, "when": dr.why, "drained": dr.worker,
           "drain_answer": dr.answer, "undrain_answer": back,
           "error": dr.error, "counters": {"before": c0, "at_drain": dr.at, "after": c2}, "phases": phases,
           "turns_after_drain": len(after), "continued_conversation_turns_after_drain": len(moved),
           "continued_conversations": len(first_moved),
           "their_first_prompts_after_drain_less_system": sum(x["prompt"] - CS.PROF.system_len
                                                              for x in first_moved.values()),
           "new_tokens_later_turns_after_drain": sum(x["new"] or 0 for x in after if x["turn"] > 1),
           "new_tokens_after_drain": sum(x["new"] or 0 for x in after),
           "first_turns_after_drain": sum(1 for x in after if x["turn"] == 1),
           "tool": {k: row[k] for k in ("tool", "ok", "failed", "ttft_p50", "ttft_p95", "tpot_p50", "req_s")},
           "records": records}
    (out / "drain.json").write_text(json.dumps(rep, indent=1, default=str) + "\n")
    text = report(rep)
    (out / "drain.md").write_text(text)
    print("\n" + text)
    return rep


def report(rep: dict) -> str:
    c = rep["counters"]
    cols = ("requests", "prompt", "local_hits", "ext_hits", "computed")
    lines = [f"aiperf conversations through pdctl's proxy; {rep['drained'] or 'no worker'} drained "
             f"{rep['when']} ({rep['error'] or 'control route answered ' + json.dumps(rep['drain_answer'])}); "
             f"aiperf: {rep['tool']['ok']} turns ok / {rep['tool']['failed']} failed, TTFT p50 "
             f"{rep['tool']['ttft_p50'] / 1000:.3f} s, p95 {rep['tool']['ttft_p95'] / 1000:.3f} s.", "",
             "Per worker, the engines' counters (cumulative) before the tool / at the drain / after the tool:", "",
             "| worker | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for w in c["before"]["workers"]:
        cells = []
        for k in cols:
            vals = [c[s]["workers"][w][k] if c.get(s) else None for s in ("before", "at_drain", "after")]
            cells.append(" / ".join("-" if v is None else f"{v:.0f}" for v in vals))
        lines.append(f"| {w}{' (drained)' if w == rep['drained'] else ''} | " + " | ".join(cells) + " |")
    lines += ["", "Per phase, the change (tool start -> drain, drain -> end):", "",
              "| phase | worker | requests | prompt | local hits | external (LMCache) hits | computed |",
              "|---|---|---|---|---|---|---|"]
    for ph, d in rep["phases"].items():
        if not d:
            continue
        for w, x in d["workers"].items():
            lines.append(f"| {ph} | {w} | {x['requests']:.0f} | {x['prompt']:.0f} | {x['local_hits']:.0f} | "
                         f"{x['ext_hits']:.0f} | {x['computed']:.0f} |")
        lines.append(f"| {ph} | proxy decisions | " + json.dumps(d.get("decisions")) + " | | | | |")
    a = (rep["phases"] or {}).get("after_drain")
    if a:
        comp = sum(x["computed"] for x in a["workers"].values())
        ext = sum(x["ext_hits"] for x in a["workers"].values())
        lines += ["", f"After the drain: {rep['turns_after_drain']} turns sent by aiperf, "
                  f"{rep['continued_conversation_turns_after_drain']} of them in {rep['continued_conversations']} "
                  f"conversations begun before the drain, {rep['first_turns_after_drain']} first turns. The "
                  f"continued conversations' first turns after the drain carried "
                  f"{rep['their_first_prompts_after_drain_less_system']} prompt tokens beyond the system prompt "
                  f"(their history + the new message); the engines loaded {ext:.0f} tokens from LMCache (external "
                  f"hits) in that phase. Computed {comp:.0f} prompt tokens in that phase, against "
                  f"{rep['new_tokens_later_turns_after_drain']} new tokens of its later turns (turn k's prompt less "
                  f"turn k-1's) + what its {rep['first_turns_after_drain']} first turns did not find cached."]
    return "\n".join(lines) + "\n"
