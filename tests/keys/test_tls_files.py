"""What preflight and doctor say of the TLS files (appliance/keys/tls.py): a good pair, an expired and an
expiring certificate, a key that is not the certificate's, a half-configured section, a file the service user
cannot read, and the warning for keys over plain HTTP. Certificates made on the spot (tests/tlscerts.py)."""
from __future__ import annotations

import datetime as dt
import shutil
import tempfile
from pathlib import Path

import pytest

from appliance.keys import tls as T
from tests.tlscerts import CA


@pytest.fixture
def ca(tmp_path):
    return CA(tmp_path / "pki")


def files(c, k="", ca="") -> T.TlsFiles:
    return T.TlsFiles(str(c), str(k), str(ca) if ca else "")


def test_a_good_pair_is_ok_and_names_its_end(ca):
    s = ca.issue("server", days=200)
    got = T.check_files(files(s.cert, s.key, ca.pem), "root")
    assert [f.status for f in got] == ["ok"] and "mutual TLS" in got[0].what, got
    assert T.check_files(T.TlsFiles(), "root") == []


def test_expired_fails_and_expiring_soon_warns(ca):
    old = ca.issue("old", days=-1, not_before_days=-30)
    soon = ca.issue("soon", days=5)
    (f,) = T.check_files(files(old.cert, old.key), "root")
    assert f.status == "fail" and "expired" in f.what and "systemctl reload pd-proxy" in f.fix
    (f,) = T.check_files(files(soon.cert, soon.key), "root")
    assert f.status == "warn" and ("(in 4 d)" in f.what or "(in 5 d)" in f.what), f
    late = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=6)
    assert T.check_files(files(soon.cert, soon.key), "root", now=late)[0].status == "fail"


def test_bad_files_name_the_key_the_file_and_the_fix(ca, tmp_path):
    a, b = ca.issue("a"), ca.issue("b")
    cases = [(files(a.cert, b.key), "tls_key_file", "does not match"),
             (files(a.key, a.key), "tls_cert_file", "holds no PEM certificate"),
             (files(a.cert, a.cert), "tls_key_file", "not a PEM private key"),
             (files(a.cert, tmp_path / "missing.key"), "tls_key_file", "no such file"),
             (files(a.cert, "relative.key"), "tls_key_file", "not an absolute path"),
             (files(a.cert, a.key, a.key), "tls_client_ca_file", "not a PEM CA certificate"),
             (T.TlsFiles(str(a.cert), ""), "tls_cert_file", "without tls_key_file"),
             (T.TlsFiles("", str(a.key), ""), "tls_key_file", "without tls_cert_file"),
             (T.TlsFiles("", "", str(ca.pem)), "tls_client_ca_file", "needs TLS on")]
    for f, key, what in cases:
        with pytest.raises(T.TlsError) as e:
            T.server_context(f)
        assert e.value.key == key and what in str(e.value) and e.value.fix, (f, str(e.value))
        (finding,) = T.check_files(f, "root")
        assert finding.status == "fail" and what in finding.what


def test_a_key_the_service_user_cannot_read(ca, tmp_path):
    s = ca.issue("server")
    s.key.chmod(0o600)                      # root's, and nobody else's
    assert T.readable_by(str(s.key), "root") is True
    assert T.readable_by(str(s.key), "nobody") is False
    assert T.readable_by(str(s.key), "no-such-user-here") is None
    got = T.check_files(files(s.cert, s.key), "nobody")
    assert got[0].status == "fail" and "cannot read it" in got[0].what and "chmod 0640" in got[0].fix
    open_dir = Path(tempfile.mkdtemp(dir="/var/tmp"))        # searchable by everyone (pytest's tmp is 0700)
    try:
        open_dir.chmod(0o755)
        key = Path(shutil.copy(s.key, open_dir / "server.key"))
        key.chmod(0o640)
        assert T.readable_by(str(key), "nobody") is False     # root's group, not nobody's
        key.chmod(0o644)
        assert T.readable_by(str(key), "nobody") is True
    finally:
        shutil.rmtree(open_dir)


def test_keys_over_plain_http_warn_only_beyond_loopback():
    assert T.plain_keys_warning("0.0.0.0", tls_on=False, keys_on=True)
    assert T.plain_keys_warning("127.0.0.1", tls_on=False, keys_on=True) is None
    assert T.plain_keys_warning("0.0.0.0", tls_on=True, keys_on=True) is None
    assert T.plain_keys_warning("0.0.0.0", tls_on=False, keys_on=False) is None
