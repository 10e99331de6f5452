"""``pdctl status --keys`` rendering (appliance/views/keys_table.py): the proxy's counts beside the file's class
and limits; a key never used, one no longer in the file, and no file at all."""
from __future__ import annotations

from appliance.keys import table as T
from appliance.views.keys_table import render, rows


def test_rows_join_the_live_counts_with_the_file():
    tbl = T.KeyTable((), "keys.toml")
    tbl, _ = T.added(tbl, "app", limits=T.Limits(rpm=100, tpm=5000))
    tbl, _ = T.added(tbl, "batch", klass="batch")
    tbl, _ = T.added(tbl, "idle")
    tbl = T.revoked(tbl, "idle")
    live = {"app": {"inflight": 2, "requests_last_min": 40, "tokens_last_min": 1200, "tokens_today": 9000,
                    "admitted": 55, "refused": {"rpm": 3}},
            "batch": {"inflight": 0, "requests_last_min": 1, "tokens_last_min": 10, "tokens_today": 10,
                      "admitted": 1, "refused": {}},
            "gone-from-file": {"inflight": 0, "requests_last_min": 0, "tokens_last_min": 0, "tokens_today": 5,
                               "admitted": 1, "refused": {}}}
    by = {r["key"]: r for r in rows(live, tbl)}
    assert list(by) == ["app", "batch", "idle", "gone-from-file"]
    assert by["app"]["requests_min"] == "40/100" and by["app"]["tokens_min"] == "1200/5000"
    assert by["app"]["refused"] == "rpm 3" and by["batch"]["class"] == "batch" and by["batch"]["refused"] == "-"
    assert by["idle"]["state"] == "revoked" and by["idle"]["in_flight"] == "-"
    assert by["gone-from-file"]["state"] == "not in the file" and by["gone-from-file"]["class"] == "-"
    text = render(live, tbl)
    assert text.splitlines()[0].split()[:3] == ["KEY", "CLASS", "STATE"] and "40/100" in text


def test_without_the_file_the_counts_still_show_and_say_why():
    text = render({"app": {"inflight": 1, "requests_last_min": 2, "tokens_last_min": 3, "tokens_today": 4,
                           "admitted": 5, "refused": {}}}, None, "keys.toml: permission denied")
    assert "app" in text and "classes and limits unknown: keys.toml: permission denied" in text
    assert render({}, None).startswith("no named keys")


def test_status_keys_with_no_proxy_says_so_and_exits_1(tmp_path, capsys):
    """``pdctl status --keys`` when the proxy does not answer: one clear line naming the URL, exit 1."""
    import argparse
    import json

    from appliance.errors import EXIT_FAIL
    from appliance.stack.twin_stack import twin_plan
    from appliance.views.cli import cmd_status
    plan = twin_plan("fake:2xH200", "deepseek-v2-lite", tmp_path)        # free ports: nothing listens there
    (tmp_path / "plan.json").write_text(json.dumps(plan.to_json()))
    args = argparse.Namespace(config=tmp_path / "plan.json", keys=True, json=False, window=0.0, timeout=0.5)
    assert cmd_status(args) == EXIT_FAIL
    err = capsys.readouterr().err
    assert f"127.0.0.1:{plan.proxy.internal_port}/pdctl/status" in err and "systemctl status pd-proxy" in err, err
