"""What the front door looks like from the settings, for preflight and `pdctl doctor`: TLS files usable by the
service user and not expiring, the keys file valid and private, and keys never sent in clear text beyond this
machine. One list of ``tls.Finding`` values; the callers render them."""
from __future__ import annotations

from pathlib import Path

from .. import constants as C
from . import tls


def findings(proxy, user: str = C.SERVICE_USER) -> list:
    """``proxy``: anything with the [proxy] keys as attributes (the plan's ProxyPlan). Empty: nothing configured."""
    out = list(tls.check_files(tls.TlsFiles.of(proxy), user))
    keys_file = getattr(proxy, "keys_file", "") or ""
    if keys_file:
        from .table import KeysError, load
        try:
            table = load(Path(keys_file))
            live = sum(1 for k in table.keys if not k.revoked)
            out.append(tls.Finding("ok", f"[proxy] keys_file = {keys_file}: {live} key(s) in force, "
                                         f"{len(table.keys) - live} revoked"))
        except KeysError as e:
            out.append(tls.Finding("fail", str(e), "fix the file as the message says (`pdctl keys list` reads it)"))
    keys_on = bool(keys_file or getattr(proxy, "api_key_file", ""))
    warn = tls.plain_keys_warning(getattr(proxy, "host", C.ALL_INTERFACES), tls.TlsFiles.of(proxy).on, keys_on)
    if warn:
        out.append(tls.Finding("warn", warn, "docs/security.md, \"TLS on the public port\""))
    return out
