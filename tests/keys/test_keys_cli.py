"""``pdctl keys`` as an operator runs it (a real process): a key printed once and never again, the file 0600 with
digests only, bad input refused naming what and how to fix, concurrent edits losing nothing."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from appliance.keys import table as T


def pdctl(tmp_path, *args):
    cfg = tmp_path / "pdctl.toml"
    r = subprocess.run([sys.executable, "-m", "appliance", "keys", *args, "--file", str(tmp_path / "keys.toml"),
                        "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    return r.returncode, r.stdout, r.stderr


def test_add_list_revoke_rotate_round_trip_never_shows_a_stored_key(tmp_path):
    rc, out, err = pdctl(tmp_path, "add", "app", "--class", "batch", "--rpm", "60", "--tpm", "5000")
    assert rc == 0, err
    key = out.strip()
    assert key.startswith(T.KEY_PREFIX) and "\n" not in key            # alone on stdout: KEY=$(pdctl keys add)
    assert "only time the key is shown" in err and "not the proxy's [proxy] keys_file" in err
    p = tmp_path / "keys.toml"
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    text = p.read_text()
    assert key not in text and T.digest(key) in text
    rc, out, err = pdctl(tmp_path, "add", "prom", "--scope", "metrics")
    prom = out.strip()
    rc, listing, _ = pdctl(tmp_path, "list")
    assert rc == 0 and "app" in listing and "batch" in listing and "rpm=60 tpm=5000" in listing
    assert key not in listing and prom not in listing and T.digest(key) not in listing
    rc, out, _ = pdctl(tmp_path, "list", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["app"]["limits"]["tpm"] == 5000 and rows["prom"]["scope"] == "metrics"
    assert key not in out and T.digest(key) not in out
    assert pdctl(tmp_path, "revoke", "app")[0] == 0
    tbl = T.load(p)
    assert not tbl.match(key).active and tbl.match(prom).active
    rc, out, err = pdctl(tmp_path, "rotate", "app")
    new = out.strip()
    tbl = T.load(p)
    assert rc == 0 and new != key and tbl.match(key) is None and tbl.match(new).active
    assert tbl.named("app").limits.rpm == 60                          # class and limits kept
    assert "only time" in err


def test_bad_input_is_refused_with_what_and_how_to_fix(tmp_path):
    rc, _, err = pdctl(tmp_path, "revoke", "nobody")
    assert rc == 2 and "no key named 'nobody'" in err
    pdctl(tmp_path, "add", "app")
    rc, out, err = pdctl(tmp_path, "add", "app")
    assert rc == 2 and out == "" and "exists already: `pdctl keys rotate app`" in err
    rc, _, err = pdctl(tmp_path, "add", "no spaces")
    assert rc == 2 and "key name 'no spaces'" in err
    p = tmp_path / "keys.toml"
    os.chmod(p, 0o644)
    rc, _, err = pdctl(tmp_path, "list")
    assert rc == 2 and f"chmod 600 {p}" in err
    os.chmod(p, 0o600)
    p.write_text(p.read_text() + '\n[[key]]\nname = "hand"\nkey = "short"\n')
    rc, _, err = pdctl(tmp_path, "add", "other")
    assert rc == 2 and "[[key]] #2 ('hand')" in err and "at least 16" in err
    assert "'other'" not in p.read_text()                              # nothing written on error
    r = subprocess.run([sys.executable, "-m", "appliance", "keys", "list", "--config", str(tmp_path / "none.toml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no keys file: set keys_file" in r.stderr


def test_edits_at_the_same_time_lose_nothing(tmp_path):
    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(lambda i: pdctl(tmp_path, "add", f"k{i}"), range(6)))
    assert all(rc == 0 for rc, _, _ in results), [e for _, _, e in results]
    tbl = T.load(tmp_path / "keys.toml")
    assert sorted(k.name for k in tbl.keys) == [f"k{i}" for i in range(6)]
    for _, out, _ in results:
        assert tbl.match(out.strip()) is not None
