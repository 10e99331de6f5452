"""The audit entry's fields and the journal's native protocol, sent to a real AF_UNIX datagram socket."""
from __future__ import annotations

import socket

from appliance import sdnotify
from appliance.keys import audit


def parse_native(data: bytes) -> dict:
    """The journal's native protocol read back (both forms), as journald would."""
    out, i = {}, 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            k, _, v = line.partition(b"=")
            out[k.decode()] = v.decode()
            i = nl + 1
        else:
            n = int.from_bytes(data[nl + 1:nl + 9], "little")
            out[line.decode()] = data[nl + 9:nl + 9 + n].decode()
            i = nl + 9 + n + 1
    return out


def test_native_fields_plain_binary_and_refused_names():
    raw = sdnotify.journal_fields({"MESSAGE": "one\ntwo", "PDCTL_KEY": "app", "_PID": "1", "lower": "x",
                                   "PDCTL_NONE": None, "PRIORITY": 6})
    assert parse_native(raw) == {"MESSAGE": "one\ntwo", "PDCTL_KEY": "app", "PRIORITY": "6"}


def test_journal_send_reaches_the_socket_and_says_when_there_is_none(tmp_path):
    path = str(tmp_path / "journal.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
        srv.bind(path)
        srv.settimeout(5)
        entry = audit.RequestEntry("app", "POST", "chat", 200, "", "pd", 812, 64, 0.21, 1.5)
        assert sdnotify.journal_send(entry.fields(), path)
        got = parse_native(srv.recv(65536))
    assert got["SYSLOG_IDENTIFIER"] == audit.IDENT and got["PDCTL_AUDIT"] == "request"
    assert got["PDCTL_KEY"] == "app" and got["PDCTL_PROMPT_TOKENS"] == "812" and got["PDCTL_TTFT_S"] == "0.21"
    assert got["MESSAGE"] == "audit app POST chat 200 pd tokens 812+64 ttft 0.210s 1.500s"
    assert not sdnotify.journal_send(entry.fields(), str(tmp_path / "none.sock"))


def test_a_trail_without_journal_hands_entries_to_its_fallback():
    seen: list = []
    t = audit.Trail(fallback=seen.append, journal=False)
    t.emit(audit.key_change("revoke", "app", "alice", "/etc/pdctl/keys.toml"))
    assert t.sent == 1 and seen[0]["PDCTL_ACTION"] == "revoke" and seen[0]["PDCTL_BY"] == "alice"
    assert seen[0]["MESSAGE"] == "audit key revoke app by alice: /etc/pdctl/keys.toml"
