"""Parsers for real `systemctl show` / `journalctl -o json` output (captured from systemd 252 in nspawn),
the metric-name table, histogram quantiles, the journal/unit-action argv, and `pdctl status` end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from collector_servers import lmcache_metrics, make_plan, proxy_metrics, vllm_metrics

from appliance.views import journal
from appliance.views.actions import run_unit_action, unit_action_argv
from appliance import metric_names as N
from appliance.collector.rates import quantile
from appliance.collector.units import SystemctlUnits, parse_show, show_argv
from appliance.inventory import is_na

FIX = Path(__file__).parent / "fixtures"
UNITS = ["pd-worker@prefill-0.service", "pd-proxy.service", "pd-kvcache.service"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("fixture", ["systemctl_show_unix.txt", "systemctl_show_pretty.txt"])
def test_parse_real_systemctl_show(fixture):
    states = parse_show((FIX / fixture).read_text(), UNITS)
    w, p, k = (states[u] for u in UNITS)
    assert (w.active, w.sub, w.restarts, w.main_pid, w.status_text) == ("active", "running", 0, 59,
                                                                       "serving on :8100")
    assert w.since == 1796024139.0
    assert (p.active, p.sub, p.restarts) == ("failed", "failed", 3)
    assert is_na(p.status_text) and p.since == 1796024140.0
    assert is_na(k.active) and "not installed" in k.active.reason


def test_parse_show_without_ids_falls_back_to_order_and_reports_missing_blocks():
    text = "ActiveState=active\nSubState=running\nNRestarts=1\n\nActiveState=inactive\nSubState=dead\n"
    st = parse_show(text, ["a.service", "b.service"])
    assert st["a.service"].restarts == 1 and st["b.service"].active == "inactive"
    st = parse_show("Id=a.service\nActiveState=active\n", ["a.service", "c.service"])
    assert is_na(st["c.service"].active) and "no block" in st["c.service"].active.reason


def test_show_argv_is_argv_form():
    argv = show_argv(["pd-proxy.service"])
    assert argv[:2] == ["systemctl", "show"] and argv[-2:] == ["--", "pd-proxy.service"]
    assert "--timestamp=unix" in argv and any("NRestarts" in a for a in argv)


def test_systemctl_units_real_subprocess_gives_na_off_systemd():
    states = SystemctlUnits().states(["pd-no-such-unit.service"])
    st = states["pd-no-such-unit.service"]
    assert is_na(st.active)        # this host: not booted with systemd; a systemd host: not installed
    missing = SystemctlUnits(systemctl="/nonexistent/systemctl").states(["x.service"])["x.service"]
    assert "systemctl not found" in missing.active.reason


def test_journal_parses_real_json_and_its_traps():
    lines = journal.parse((FIX / "journal_workers.json").read_text())
    assert len(lines) == 25
    own = [ln for ln in lines if ln.ident == "pd-worker@prefill-0"]
    assert [ln.message for ln in own] == ["hello from prefill-0", "an error line"]
    assert own[1].priority == 3 and own[0].unit == "pd-worker@prefill-0.service"
    restarts = [ln for ln in lines if "restart counter is at" in ln.message]
    assert len(restarts) == 3 and all(ln.unit == "pd-proxy.service" for ln in restarts)
    odd = journal.parse_line(json.dumps({"MESSAGE": [104, 105, 255], "PRIORITY": "4",
                                         "__REALTIME_TIMESTAMP": "1796024139981816", "_SYSTEMD_UNIT": "x"}))
    assert odd.message == "hi\ufffd" and odd.priority == 4 and odd.ts == pytest.approx(1796024139.98)
    assert "4096" in journal.parse_line('{"MESSAGE": null}').message
    assert journal.parse_line("not json") is None and journal.parse_line("") is None


def test_journal_argv_and_unit_names():
    argv = journal.journal_argv(["pd-proxy.service"], since="-10min", lines=50, priority="err", follow=True)
    assert argv[:3] == ["journalctl", "-o", "json"] and ["-u", "pd-proxy.service"] == argv[5:7]
    assert "--since=-10min" in argv and "--priority=err" in argv and argv[-1] == "--follow"
    with pytest.raises(ValueError, match="priority"):
        journal.journal_argv([], priority="loud")
    assert journal.resolve_unit("prefill-0") == "pd-worker@prefill-0.service"
    assert journal.resolve_unit("decode", ["prefill-0", "decode-0"]) == "pd-worker@decode-0.service"
    assert journal.resolve_unit("proxy") == "pd-proxy.service"
    assert journal.resolve_unit("kv") == "pd-kvcache.service"
    assert journal.resolve_unit("foo.service") == "foo.service"


def test_unit_actions_are_argv_and_refuse_foreign_units():
    assert unit_action_argv("restart", "pd-proxy.service") == ["systemctl", "restart", "--no-block", "--",
                                                               "pd-proxy.service"]
    with pytest.raises(ValueError):
        unit_action_argv("mask", "pd-proxy.service")
    bad = run_unit_action("restart", "sshd.service")
    assert not bad.ok and "not a pdctl unit" in bad.message
    res = run_unit_action("restart", "pd-proxy.service", systemctl="/nonexistent/systemctl")
    assert not res.ok and "not found" in res.message


def test_metric_name_table_per_version():
    present = frozenset({"vllm:gpu_prefix_cache_hits", "vllm:prefix_cache_hits"})
    assert N.resolve(N.VLLM, "prefix_hits", present, "0.8.5") == "vllm:gpu_prefix_cache_hits"
    assert N.resolve(N.VLLM, "prefix_hits", present, "0.33.0") == "vllm:prefix_cache_hits"
    assert N.resolve(N.VLLM, "prefix_hits", frozenset({"vllm:prefix_cache_hits"}), "0.8.5") == \
        "vllm:prefix_cache_hits"      # a mislabelled version still finds what the engine exposes
    assert N.resolve(N.VLLM, "ext_hits", present, "0.33.0") is None
    assert N.expected(N.VLLM, "kv_usage", "0.33.0") == ("vllm:kv_cache_usage_perc",)


def test_quantile_interpolates_like_histogram_quantile():
    b = {0.1: 50.0, 0.5: 90.0, 1.0: 100.0, float("inf"): 100.0}
    assert quantile(0.5, b) == pytest.approx(0.1)
    assert quantile(0.7, b) == pytest.approx(0.1 + 0.4 * 20 / 40)
    assert quantile(0.95, b) == pytest.approx(0.5 + 0.5 * 5 / 10)
    assert quantile(0.99, {1.0: 0.0, float("inf"): 10.0}) == 1.0
    assert is_na(quantile(0.5, {1.0: 0.0, float("inf"): 0.0}))
    assert is_na(quantile(0.5, {1.0: 3.0}))


def test_pdctl_status_end_to_end(endpoints, tmp_path):
    p, kv, px, pxi = (endpoints() for _ in range(4))
    plan = make_plan({"both-0": (p.port, [])}, kv.port, px.port, pxi.port, engine="vllm-cpu")
    p.set("/health", "")
    p.set("/metrics", vllm_metrics(prefix_q=100, prefix_h=50, ext_q=100, ext_h=25))
    kv.set("/healthcheck", "")
    kv.set("/metrics", lmcache_metrics(100, 50))
    px.set("/metrics", proxy_metrics(5, [0.2] * 5))
    px.set("/ready", "ok")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "appliance", "status", "--config", str(path), "--window", "0.2"],
                         capture_output=True, text=True, timeout=30, cwd=ROOT, env=env)
    assert "both-0" in run.stdout and "prefill saved" in run.stdout, run.stderr
    assert "gpus: NA" in run.stdout and "CPU engine" in run.stdout      # why the GPU table is empty
    assert run.returncode in (0, 1)
    run = subprocess.run([sys.executable, "-m", "appliance", "status", "--json", "--config", str(path),
                          "--window", "0"], capture_output=True, text=True, timeout=30, cwd=ROOT, env=env)
    doc = json.loads(run.stdout)
    assert doc["workers"][0]["health"] == "ok" and doc["proxy"]["ready"] == "ready"
    bad = subprocess.run([sys.executable, "-m", "appliance", "status", "--config", str(tmp_path / "nope.json")],
                         capture_output=True, text=True, timeout=30, cwd=ROOT, env=env)
    assert bad.returncode == 2 and "not found" in bad.stderr


def _canon(fams: dict) -> dict:
    return {k: sorted((n, tuple(sorted(lab.items())), v) for n, lab, v in vals) for k, vals in fams.items()}


def test_cached_parse_agrees_with_prometheus_client_on_a_real_scrape():
    from appliance.collector import derive as col
    from appliance.wire.prom import _TEMPLATES, parse_metrics, prefilter, reference_parse
    text = (FIX / "vllm_cpu_0.32.txt").read_text()
    whole = parse_metrics(text)
    assert len(whole.families) > 80
    assert whole.families == reference_parse(text).families
    for wanted in (col._W_WANTED, col._K_WANTED, col._P_WANTED, None):
        for t in (text, lmcache_metrics(10, 5, evicted=2), proxy_metrics(3, [0.1, 2.0], {"short": 1})):
            ref = reference_parse(prefilter(t, wanted) if wanted is not None else t)
            assert parse_metrics(t, wanted).families == ref.families
    # same series, new values: the cached structure is reused and the values are the new ones
    a = proxy_metrics(3, [0.1, 2.0], {"short": 1})
    b = proxy_metrics(7, [0.1, 2.0, 0.3, 0.4, 5.0, 0.2, 0.1], {"short": 4})
    n = len(_TEMPLATES)
    assert parse_metrics(b).families == reference_parse(b).families
    assert parse_metrics(a).families == reference_parse(a).families and len(_TEMPLATES) == n
    # what the cached path does not fully understand goes to prometheus_client whole
    escaped = '# TYPE m gauge\nm{path="a\\"b"} 1.0\n'
    assert parse_metrics(escaped).families["m"][0][1] == {"path": 'a"b'}
    spaced = '# TYPE m gauge\nm{path="a b} c"} 2.5\n'
    assert parse_metrics(spaced).families == reference_parse(spaced).families
    stamped = '# TYPE m_total counter\nm_total{a="x"} 3 1700000000000\n'
    assert parse_metrics(stamped).families == reference_parse(stamped).families == {"m": [("m_total", {"a": "x"}, 3.0)]}
    quirk = '# TYPE m counter\nm_total{a="x"} 3\n'          # prometheus_client makes m_total its own family
    assert parse_metrics(quirk).families == reference_parse(quirk).families
    odd = '# TYPE m gauge\nm 1_000\n'
    assert isinstance(parse_metrics(odd), str) and isinstance(reference_parse(odd), str)
    assert parse_metrics("# TYPE m gauge\nm NaN\nm2 +Inf\n").families.keys() == {"m", "m2"}
    assert isinstance(parse_metrics("garbage{{{ 1\n"), str)
    kept = prefilter(text, frozenset({"vllm:num_requests_waiting"}))
    assert "waiting_by_reason" not in kept and "vllm:num_requests_waiting{" in kept and "# HELP" not in kept


def test_prefilter_keeps_every_family_the_collector_reads():
    from appliance.collector import derive as col
    from appliance import metric_names as N
    from appliance.wire.prom import parse_metrics, reference_parse
    text = (FIX / "vllm_cpu_0.32.txt").read_text()
    full, kept = reference_parse(text), parse_metrics(text, col._W_WANTED)
    for logical in col._W_LOGICAL:
        name = N.resolve(N.VLLM, logical, full.names, "0.32.0")
        assert name is not None and N.resolve(N.VLLM, logical, kept.names, "0.32.0") == name
        assert kept.families[name] == full.families[name]


def test_fetch_all_runs_every_get_at_once_and_reports_each_failure(endpoints):
    from appliance.collector.scrape import Scraper
    ok, slow, gone = endpoints(), endpoints(), endpoints()
    ok.set("/metrics", "# TYPE m gauge\nm 1\n")
    ok.set("/bad", "nope", status=503)
    slow.set("/health", "")
    slow.hang.add("/health")
    port = gone.port
    gone.close()
    f = Scraper(0.4)
    t0 = time.monotonic()
    got = f.fetch_all({"a": f"http://127.0.0.1:{ok.port}/metrics", "b": f"http://127.0.0.1:{ok.port}/bad",
                       "c": f"http://127.0.0.1:{slow.port}/health", "d": f"http://127.0.0.1:{port}/metrics",
                       "e": f"http://localhost:{ok.port}/metrics", "f": f"http://127.0.0.1:{ok.port}x/metrics"})
    took = time.monotonic() - t0
    assert got["a"].ok and got["a"].status == 200 and got["a"].text == "# TYPE m gauge\nm 1\n"
    assert got["b"].error == "HTTP 503" and got["b"].status == 503 and got["b"].text == "nope"
    assert got["c"].error == "no answer within 0.4s"
    assert got["d"].error == f"connect to 127.0.0.1:{port}: connection refused (not listening)" and got["d"].unreachable
    assert got["e"].ok
    assert not got["f"].ok and got["f"].status == 0 and "port" in got["f"].error.lower()
    assert took < 15        # the batch ends at the 0.4 s time-out, not the 60 s hang (~0.45 s; 15 s: a hang bound)
    f.close()


def test_answers_larger_than_the_read_buffer_arrive_whole_and_apart(endpoints):
    """Every pool reads into one shared 256 KiB buffer: answers bigger than it, read at once, stay apart."""
    from appliance.collector.scrape import Scraper
    eps = [endpoints() for _ in range(3)]
    bodies = {i: "".join(f"m{i}_{j} {j}\n" for j in range(60_000)) for i in range(3)}    # ~0.6 MB each
    for i, e in enumerate(eps):
        e.set("/metrics", bodies[i])
    f = Scraper(5.0)
    for _ in range(2):
        got = f.fetch_all({i: f"http://127.0.0.1:{e.port}/metrics" for i, e in enumerate(eps)})
        assert all(got[i].ok and got[i].text == bodies[i] for i in range(3))
    f.close()


def test_keep_alive_scraper_reuses_its_connection_and_survives_a_server_close():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from appliance.collector.scrape import Scraper
    conns: list = []

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            conns.append(self.client_address)

        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", "2")
            if self.path == "/bye":
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *a) -> None:
            pass
    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        f = Scraper(0.5)
        url = f"http://127.0.0.1:{srv.server_address[1]}/metrics"

        def get(u: str):
            return f.fetch_all({0: u})[0]
        assert all(get(url).text == "ok" for _ in range(5))
        assert len(conns) == 1
        bye = url.replace("/metrics", "/bye")
        assert get(bye).ok and get(bye).ok
        assert len(conns) == 2                    # the server closed the kept one after /bye: a fresh one
        f.close()
        assert get(url).ok and len(conns) == 3    # closed means closed; a later batch connects anew
        f.close()
    finally:
        srv.shutdown()
        srv.server_close()


def test_pdctl_logs_runs_journalctl(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "appliance", "logs", "proxy", "-n", "5", "--config",
                          str(tmp_path / "none.json")], capture_output=True, text=True, timeout=30, cwd=ROOT, env=env)
    assert run.returncode in (0, 1)               # 0: journal read (maybe empty); 1: no journalctl, said why
    assert run.returncode == 0 or "journalctl" in run.stderr
    bad = subprocess.run([sys.executable, "-m", "appliance", "logs", "-p", "loud", "--config",
                          str(tmp_path / "none.json")], capture_output=True, text=True, timeout=30, cwd=ROOT, env=env)
    assert bad.returncode == 2 and "priority" in bad.stderr
