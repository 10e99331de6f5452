"""The keys file: what it accepts, how it refuses (file, entry, fix), its permissions, and the edits."""
from __future__ import annotations

import os

import pytest

from appliance.keys import table as T

GOOD = '''
[[key]]
name = "chat-backend"
sha256 = "{h}"
class = "interactive"
rpm = 600

[[key]]
name = "batch.eval"
key = "a-hand-written-key-of-enough-length"
class = "batch"
tpm = 50000
max_streams = 4

[[key]]
name = "prom"
sha256 = "{h2}"
scope = "metrics"
revoked = "2026-12-01T00:00:00Z"
'''


def good_text() -> str:
    return GOOD.format(h=T.digest("sk-pd-chat"), h2=T.digest("sk-pd-prom"))


def test_a_good_file_names_each_key_with_its_class_scope_and_limits():
    tbl = T.parse(good_text(), "/etc/pdctl/keys.toml")
    assert [k.name for k in tbl.keys] == ["chat-backend", "batch.eval", "prom"]
    chat, batch, prom = tbl.keys
    assert (chat.klass, chat.scope, chat.limits.rpm, chat.active) == ("interactive", "api", 600, True)
    assert (batch.klass, batch.limits.tpm, batch.limits.max_streams) == ("batch", 50000, 4)
    assert batch.sha256 == T.digest("a-hand-written-key-of-enough-length")     # a clear key is kept as its digest
    assert (prom.scope, prom.active) == ("metrics", False)
    assert tbl.match("sk-pd-chat") is chat and tbl.match("a-hand-written-key-of-enough-length") is batch
    assert tbl.match("sk-pd-prom") is prom            # revoked keys are found, so the door can say "revoked"
    assert tbl.match("sk-pd-other") is None and tbl.match("") is None


@pytest.mark.parametrize("entry, words", [
    ('name = "x"\nsha256 = "abc"', ["#1 ('x')", "sha256 must be 64 hex digits", "sha256sum"]),
    ('name = "x"', ["#1 ('x')", "exactly one of sha256", "pdctl keys add"]),
    ('name = "bad name"\nkey = "0123456789abcdefXYZ"', ["#1 ('bad name')", "name must be"]),
    ('name = "x"\nkey = "short"', ["#1 ('x')", "at least 16", "pdctl keys add"]),
    ('name = "x"\nkey = "0123456789abcdefXYZ"\nclass = "vip"', ["class must be one of interactive, batch"]),
    ('name = "x"\nkey = "0123456789abcdefXYZ"\nscope = "admin"', ["scope must be one of api, metrics"]),
    ('name = "x"\nkey = "0123456789abcdefXYZ"\nrpm = -1', ["rpm (requests per minute)", ">= 0"]),
    ('name = "x"\nkey = "0123456789abcdefXYZ"\ntpm = "lots"', ["tpm", "whole number"]),
    ('name = "x"\nkey = "0123456789abcdefXYZ"\nrpn = 5', ["unknown field(s) rpn", "known: name"]),
])
def test_a_bad_entry_is_refused_naming_file_entry_and_fix(entry, words):
    with pytest.raises(T.KeysError) as e:
        T.parse(f"[[key]]\n{entry}\n", "/etc/pdctl/keys.toml")
    msg = str(e.value)
    assert msg.startswith("/etc/pdctl/keys.toml: [[key]] #1"), msg
    for w in words:
        assert w in msg, (w, msg)


def test_whole_file_mistakes_are_refused():
    for text, words in [("[[key]\n", "not valid TOML"), ("[key]\nname = 'x'\n", "[[key]] sections"),
                        ("[proxy]\nx = 1\n", "unknown section(s) proxy"),
                        ('[[key]]\nname = "a"\nkey = "0123456789abcdefXYZ"\n[[key]]\nname = "a"\n'
                         'key = "0123456789abcdefXYZ-2"\n', "name 'a' is used by #1 too"),
                        ('[[key]]\nname = "a"\nkey = "0123456789abcdefXYZ"\n[[key]]\nname = "b"\n'
                         'key = "0123456789abcdefXYZ"\n', "'a' and 'b' are the same key")]:
        with pytest.raises(T.KeysError, match="keys.toml") as e:
            T.parse(text, "keys.toml")
        assert words in str(e.value), (words, str(e.value))


def test_render_keeps_no_secret_and_reads_back_the_same():
    tbl = T.parse(good_text(), "k")
    text = T.render(tbl)
    assert "a-hand-written-key" not in text and "key = " not in text.replace("[[key]]", "")
    again = T.parse(text, "k")
    assert again.keys == tbl.keys
    assert T.parse(T.render(T.KeyTable((), "k")), "k").keys == ()


def test_add_revoke_rotate():
    tbl = T.KeyTable((), "keys.toml")
    tbl, s1 = T.added(tbl, "app", "batch", "api", T.Limits(rpm=5))
    assert s1.startswith(T.KEY_PREFIX) and len(s1) > 40
    assert tbl.match(s1).name == "app" and tbl.named("app").limits.rpm == 5 and tbl.named("app").created
    with pytest.raises(T.KeysError, match="exists already: `pdctl keys rotate app`"):
        T.added(tbl, "app")
    tbl = T.revoked(tbl, "app")
    assert not tbl.match(s1).active
    with pytest.raises(T.KeysError, match="revoked already"):
        T.revoked(tbl, "app")
    tbl, s2 = T.rotated(tbl, "app")
    assert s2 != s1 and tbl.match(s1) is None and tbl.match(s2).active and tbl.named("app").klass == "batch"
    with pytest.raises(T.KeysError, match=r"no key named 'nobody' \(keys: app\)"):
        T.revoked(tbl, "nobody")


def test_a_file_others_can_read_is_refused_with_the_fix(tmp_path):
    p = tmp_path / "keys.toml"
    p.write_text(good_text())
    os.chmod(p, 0o600)
    assert [k.name for k in T.load(p).keys] == ["chat-backend", "batch.eval", "prom"]
    os.chmod(p, 0o644)
    with pytest.raises(T.KeysError, match=r"mode 0644 lets every user read it: `chmod 600 .*keys.toml`"):
        T.load(p)
    os.chmod(p, 0o660)
    with pytest.raises(T.KeysError, match="lets group"):
        T.load(p)
    assert "owned by uid 4242" in T.permission_problem(p, type("S", (), {"st_uid": 4242, "st_gid": 0,
                                                                         "st_mode": 0o100600})(), {0}, None)
    with pytest.raises(T.KeysError, match="does not exist: create it with `pdctl keys add NAME`"):
        T.load(tmp_path / "none.toml")
