"""What the help screen says: every key, and what every number on the dashboard counts (one line each)."""
from __future__ import annotations

import textwrap

from rich.markup import escape

KEYS = (
    ("tab / shift+tab", "move between the roles table, the GPU table and the journal"),
    ("↑ ↓", "select a row (a unit in the roles table)"),
    ("enter", "detail of the selected unit: its engine metrics, its GPU, its last journal lines"),
    ("l", "show / hide the journal of the selected unit"),
    ("u / a", "in the journal: next unit / all units (the unit filter)"),
    ("f", "the fleet table full height and back (a box that is also the fleet's front node)"),
    ("r", "restart the selected unit (asks first)"),
    ("s", "stop / start the selected unit (asks first)"),
    ("p", "pause / resume refreshing (the collector keeps polling)"),
    ("?", "this help (↑ ↓ scroll it)"),
    ("escape", "close a dialog, the help or a detail"),
    ("q", "quit"),
)

NUMBERS = (
    ("header", "plan shape (1P3D: 1 prefill + 3 decode workers; B: workers that serve either leg), GPU model "
               "and count, served model, engine and version, proxy uptime; then READY / STARTING / ROLLING / "
               "DEGRADED / DOWN and the one reason that matters most (ROLLING: `sudo pdctl apply` restarts the "
               "workers a batch at a time and nothing else fails; the roles table's title says how far)"),
    ("TTFT p50/p95", "time to first token at the proxy (arrival to first token out), over the window, from the "
                     "proxy's histogram; chart: one column per tick (max of the ticks it covers), p50 cyan "
                     "over p95 blue, red above the SLO line"),
    ("TPOT p50/p95", "time between output tokens over every token the engines streamed in the window "
                     "(vLLM's inter-token latency histogram; a P leg emits one token and adds nothing)"),
    ("SLO", "the objective from pdctl.toml ([workload] ttft_slo_s, tpot_slo_ms): the dotted line"),
    ("goodput", "streamed answers per second that met both SLOs (TTFT from arrival, the answer's own TPOT), "
                "always beside the refusals and the queue: a goodput that hides its refusals is inflated; wait "
                "p95: time spent in the admission queue"),
    ("req/s", "client requests through the proxy per second (the proxy's own canary left out)"),
    ("in / out tok/s", "prompt tokens the engines took in / tokens they generated, per second, all workers"),
    ("errors/s", "client requests that failed on the box's side (5xx, unavailable); the client's own 4xx "
                 "mistakes and admission's refusals (refused/s) are not counted"),
    ("refused/s", "requests the proxy's admission refused per second (503 + Retry-After, before any engine saw "
                  "them; a client that left the queue included): their reasons are in `pdctl status`"),
    ("queued", "requests waiting in the proxy's admission queue now ([admission] mode slo or queue)"),
    ("migr/s", "streams moved to another worker mid-answer (a decode leg that broke after its first byte)"),
    ("prefill saved", "share of the clients' prompt tokens that no engine computed: taken from a cache; a "
                      "split request's D leg loading what its P leg just computed is a transfer, left out "
                      "(per worker by its share of D legs)"),
    ("engine prefix", "tokens found in each engine's own GPU prefix cache / tokens looked up there"),
    ("LMCache conn.", "tokens the engines loaded through the LMCache connector / tokens they asked it for "
                      "(includes the D legs' transfers)"),
    ("KV server", "hit tokens / requested tokens over every lookup the LMCache server answered"),
    ("L1 used", "the KV server's host-RAM cache in use, of its size; evictions/s: chunks evicted per second"),
    ("decisions", "how the proxy served requests in the window: aggregated (one worker) or split (P leg "
                  "here, D leg there), with each reason's share (appliance/policy/decide.py)"),
    ("conversations", "chat turns that named their conversation (X-Session-Id or OpenAI's user) in the window, by "
                      "what the worker of its last answer meant: stayed on it, moved_load (it was the busier one), "
                      "moved_down (it takes nothing now), new, edited (the history changed), split "
                      "(appliance/proxy/sessions.py)"),
    ("run/wait", "requests the engine is running / has waiting (vLLM gauges); kvserver: lookups/s"),
    ("KV", "the engine's KV cache blocks in use; kvserver: its L1 in use"),
    ("legs F P D", "legs the proxy has open on the worker now: full (aggregated) requests, P legs, D legs"),
    ("legs/s", "legs sent to the worker per second over the window (F P D)"),
    ("rst", "systemd restarts of the unit (NRestarts); unit: its state (active, starting, restarting, failed)"),
    ("breaker", "the proxy's circuit breaker for this backend: closed (used), open (skipped), half_open; "
                "drained: a rollout holds it out of rotation (the detail says why)"),
    ("status", "the launcher's STATUS= (what a starting engine is doing); proxy: ready or why not"),
    ("GPU rows", "utilisation and memory in use now and their history, temperature, power / limit, and the "
                 "worker bound to the GPU"),
    ("keys", "per named key (only when the proxy counted one; on a fleet front node from 40 rows): its class once "
             "admission weighed it, requests in flight, requests and tokens in the last minute (sliding), tokens "
             "today, admitted and refused by limit since the proxy started; `pdctl status --keys` adds the keys "
             "file's limits (used/limit)"),
    ("window", "rates and ratios are deltas between samples over the last ~10 s, never lifetime totals"),
)


def _hang(head: str, text: str, indent: int, width: int) -> str:
    """``head`` then ``text`` wrapped to ``width`` with a hanging indent (the help has 70 cells inside at
    80 columns: a wrapped description stays in its column instead of starting under the keys)."""
    lines = textwrap.wrap(text, width - indent) or [""]
    pad = " " * indent
    return "\n".join([f"[b]{escape(head)}[/b]{' ' * (indent - len(head))}{escape(lines[0])}"] +
                     [pad + escape(ln) for ln in lines[1:]])


def markup(width: int = 68) -> str:
    keys = "\n".join(_hang(f"  {k}", v, 19, width) for k, v in KEYS)
    nums = "\n".join(_hang(f"  {k}", v, 19, width) for k, v in NUMBERS)
    return f"[b]pdctl tui[/b] — keys\n{keys}\n\n[b]What the numbers are[/b]\n{nums}\n"
