"""TLS on the public port: the server context pdctl builds from certificate files, and the checks preflight and
`pdctl doctor` make on those files before a proxy has to (readable by the service user, key matches certificate,
not expired, not about to).

Why the standard library's ``ssl`` (issue 29): HTTP/1.1 over TLS on the proxy's own wire server, no second proxy
in front. Defaults follow Mozilla's "intermediate" profile: TLS 1.2 and 1.3 only; on TLS 1.2 only ECDHE key
exchange with AEAD ciphers (forward secrecy; no CBC, RC4, 3DES, static RSA); TLS 1.3's suites are all AEAD; no
compression, no renegotiation. ``cryptography`` reads a certificate's dates (``ssl`` has no public API for that).
"""
from __future__ import annotations

import datetime as dt
import grp
import os
import pwd
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path

MIN_VERSION = ssl.TLSVersion.TLSv1_2
CIPHERS_TLS12 = "ECDHE+AESGCM:ECDHE+CHACHA20"
EXPIRY_WARN_DAYS = 14          # a certificate this close to its end makes doctor and preflight warn
CONFIG_KEYS = ("tls_cert_file", "tls_key_file", "tls_client_ca_file")   # [proxy] keys in pdctl.toml


class TlsError(ValueError):
    """A certificate file the proxy cannot use: which [proxy] key, which file, what is wrong, how to fix it."""

    def __init__(self, key: str, path: str, what: str, fix: str):
        self.key, self.path, self.what, self.fix = key, path, what, fix
        super().__init__(f"[proxy] {key} = {path}: {what}; {fix}")


@dataclass(frozen=True)
class TlsFiles:
    """The [proxy] TLS keys; TLS is on when a certificate file is given."""
    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""      # mutual TLS: clients must show a certificate this CA signed

    @classmethod
    def of(cls, obj) -> "TlsFiles":
        """From anything with the [proxy] TLS keys as attributes (ProxyPlan, ProxyConfig)."""
        return cls(*(getattr(obj, k, "") or "" for k in CONFIG_KEYS))

    @property
    def on(self) -> bool:
        return bool(self.cert_file)

    @property
    def mutual(self) -> bool:
        return bool(self.client_ca_file)

    def paths(self) -> dict:
        """[proxy] key -> path, for the files given."""
        return {k: v for k, v in zip(CONFIG_KEYS, (self.cert_file, self.key_file, self.client_ca_file)) if v}

    def incomplete(self) -> tuple | None:
        """(the [proxy] key at fault, why) when these settings cannot run (a key without its certificate, ...)."""
        if self.key_file and not self.cert_file:
            return "tls_key_file", "set without tls_cert_file: set both (or neither, for plain HTTP)"
        if self.cert_file and not self.key_file:
            return "tls_cert_file", "set without tls_key_file: set both (or neither, for plain HTTP)"
        if self.client_ca_file and not self.cert_file:
            return "tls_client_ca_file", "mutual TLS needs TLS on: set tls_cert_file and tls_key_file too"
        return None


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """A server context from the files (read now: a rotation is a new context); TlsError naming the file."""
    half = files.incomplete()
    if half:
        key, why = half
        raise TlsError(key, getattr(files, key[len("tls_"):]), why, "fix [proxy] in pdctl.toml")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = MIN_VERSION
    ctx.set_ciphers(CIPHERS_TLS12)
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE | getattr(ssl, "OP_NO_RENEGOTIATION", 0)
    ctx.set_alpn_protocols(["http/1.1"])
    for key, path in files.paths().items():
        _readable(key, path)
    try:
        ctx.load_cert_chain(files.cert_file, files.key_file)
    except ssl.SSLError as e:
        if "KEY_VALUES_MISMATCH" in str(e):
            raise TlsError("tls_key_file", files.key_file, f"this private key does not match the certificate "
                           f"{files.cert_file}", "give the key the certificate was made with") from None
        try:
            not_after(files.cert_file)
        except ValueError:
            raise TlsError("tls_cert_file", files.cert_file, "holds no PEM certificate",
                           "give the certificate chain in PEM (leaf first)") from None
        raise TlsError("tls_key_file", files.key_file, f"not a PEM private key (OpenSSL: {e.reason or e})",
                       "give the unencrypted PEM private key of the certificate") from None
    if files.client_ca_file:
        try:
            ctx.load_verify_locations(cafile=files.client_ca_file)
        except ssl.SSLError as e:
            raise TlsError("tls_client_ca_file", files.client_ca_file, f"not a PEM CA certificate ({e.reason or e})",
                           "give the CA that signs your clients' certificates, in PEM") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _readable(key: str, path: str) -> None:
    p = Path(path)
    if not p.is_absolute():
        raise TlsError(key, path, "not an absolute path", "give the file's full path")
    try:
        with open(p, "rb") as f:
            f.read(1)
    except FileNotFoundError:
        raise TlsError(key, path, "no such file", "create it or fix the path") from None
    except IsADirectoryError:
        raise TlsError(key, path, "a directory, not a file", "give the PEM file's path") from None
    except PermissionError:
        raise TlsError(key, path, "not readable by this process", f"chown root:pdctl {path}; chmod 0640 {path}") \
            from None


# ----- the checks of preflight and doctor --------------------------------------------------------------------
@dataclass(frozen=True)
class Finding:
    status: str          # "ok" | "warn" | "fail"
    what: str            # one line
    fix: str = ""


def not_after(cert_file: str) -> dt.datetime:
    """The end of the leaf certificate's validity (UTC); ValueError when the file holds no PEM certificate."""
    from cryptography import x509
    data = Path(cert_file).read_bytes()
    certs = x509.load_pem_x509_certificates(data)      # ValueError without one
    return certs[0].not_valid_after_utc


def readable_by(path: str, user: str) -> bool | None:
    """Whether ``user`` may read ``path`` (owner/group/other bits along the path); None when the user is unknown."""
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        return None
    if pw.pw_uid == 0:
        return True
    gids = {pw.pw_gid} | {g.gr_gid for g in grp.getgrall() if user in g.gr_mem}

    def may(st: os.stat_result, owner_bit: int, group_bit: int, other_bit: int) -> bool:
        if st.st_uid == pw.pw_uid:
            return bool(st.st_mode & owner_bit)
        if st.st_gid in gids:
            return bool(st.st_mode & group_bit)
        return bool(st.st_mode & other_bit)

    p = Path(path)
    try:
        for d in reversed(p.parents):
            if not may(d.stat(), stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH):
                return False
        return may(p.stat(), stat.S_IRUSR, stat.S_IRGRP, stat.S_IROTH)
    except OSError:
        return False


def check_files(files: TlsFiles, user: str, now: dt.datetime | None = None) -> list[Finding]:
    """What doctor and preflight say about the TLS files: one Finding per problem, or one "ok" line."""
    if not files.on and not files.client_ca_file and not files.key_file:
        return []
    out: list[Finding] = []
    for key, path in files.paths().items():
        if readable_by(path, user) is False:
            out.append(Finding("fail", f"[proxy] {key} = {path}: the proxy's user {user} cannot read it",
                               f"chown root:{user} {path}; chmod 0640 {path}"))
    try:
        server_context(files)
    except TlsError as e:
        out.append(Finding("fail", f"[proxy] {e.key} = {e.path}: {e.what}", e.fix))
        return out
    end = not_after(files.cert_file)
    now = now or dt.datetime.now(dt.timezone.utc)
    left = end - now
    if left.total_seconds() <= 0:
        out.append(Finding("fail", f"[proxy] tls_cert_file = {files.cert_file}: expired {end:%Y-%m-%d %H:%M} UTC",
                           "install a renewed certificate, then `systemctl reload pd-proxy`"))
    elif left.days < EXPIRY_WARN_DAYS:
        out.append(Finding("warn", f"[proxy] tls_cert_file = {files.cert_file}: expires {end:%Y-%m-%d %H:%M} UTC "
                                   f"(in {left.days} d)",
                           "renew it, then `systemctl reload pd-proxy` (no connection is dropped)"))
    if not out:
        out.append(Finding("ok", f"TLS on the public port: certificate valid until {end:%Y-%m-%d} UTC, key matches"
                                 + (", mutual TLS (client CA given)" if files.mutual else "")))
    return out


def plain_keys_warning(host: str, tls_on: bool, keys_on: bool) -> str | None:
    """Keys sent in clear text: API keys on, TLS off, and the public port reachable beyond this machine."""
    if not keys_on or tls_on or host in ("127.0.0.1", "::1", "localhost"):
        return None
    return (f"API keys are on but the public port ({host}) speaks plain HTTP: every key crosses the network in "
            "clear text; set [proxy] tls_cert_file and tls_key_file (docs/security.md), or bind 127.0.0.1 behind "
            "your own TLS terminator")
