"""The public port's door: who sent a request, whether that key may use this route, and within its limits.

Every route of the public port passes here first (app.py wraps the public table), so no handler checks a key
itself. Keys come from ``[proxy] keys_file`` (named keys, appliance/keys) and the single ``api_key_file`` (a key
named ``api_key_file`` with no limits, as before). With no key configured the door is open. Open always:
``/health`` and ``/ready`` (load balancers). ``/metrics`` takes a key of scope ``metrics`` (a read-only scrape
key) or the single ``api_key_file`` key; the loopback internal port serves it without a key. An ``api`` key
cannot read ``/metrics`` (it names every key). A revoked key is told so (401 ``revoked_api_key``); its open
streams finish. Per-key limits (appliance/keys/quota.py): generations reserve their tokens after parsing
(orchestrate.generate), every other guarded route counts as one request of 0 tokens here.
"""
from __future__ import annotations

from ..keys.quota import Verdict
from ..keys.table import CLASS_WEIGHTS, CLASSES, KeyTable, NamedKey, digest
from .errors import ProxyError

OPEN_PATHS = frozenset({"/health", "/ready"})
METRICS_PATH = "/metrics"
LEGACY_NAME = "api_key_file"     # the single [proxy] api_key_file key, as a named key

MISSING = ProxyError(401, "missing API key: send 'Authorization: Bearer <key>' (`pdctl keys add NAME` makes "
                          "one; the single key of [proxy] api_key_file works too)", "authentication_error",
                     "invalid_api_key")
WRONG = ProxyError(401, "wrong API key: no key of this box matches it (`pdctl keys list` on the box shows the "
                        "names)", "authentication_error", "invalid_api_key")


def revoked(k: NamedKey) -> ProxyError:
    return ProxyError(401, f"API key {k.name!r} was revoked ({k.revoked}): ask the box's operator for a new one "
                           f"(`pdctl keys rotate {k.name}`)", "authentication_error", "revoked_api_key")


def wrong_scope(k: NamedKey, path: str) -> ProxyError:
    if path == METRICS_PATH:
        why = (f"key {k.name!r} (scope {k.scope}) cannot read /metrics: use a scrape key (`pdctl keys add NAME "
               "--scope metrics`) or the loopback internal port")
    else:
        why = f"key {k.name!r} is a metrics scrape key (scope metrics): it may only read /metrics"
    return ProxyError(403, why, "permission_error", "insufficient_scope")


def over_limit(v: Verdict) -> ProxyError:
    return ProxyError(429, f"{v.message}; retry after {v.retry_after_s:.3g} s", "rate_limit_error",
                      f"rate_limit_{v.limit}")


def keyring(cfg) -> KeyTable | None:
    """The keys the door accepts: the named keys plus the single ``api_key`` (None: the door is open)."""
    named = cfg.keys
    if cfg.api_key is None and named is None:
        return None
    keys = tuple(named.keys) if named is not None else ()
    if cfg.api_key is not None and not any(k.name == LEGACY_NAME for k in keys):
        keys += (NamedKey(LEGACY_NAME, digest(cfg.api_key), scope="*"),)
    return KeyTable(keys, named.source if named is not None else "[proxy] api_key_file")


def bearer(request) -> str:
    got = request.headers.get("authorization", "")
    return got[7:].strip() if got[:7].lower() == "bearer " else ""


def identify(ring: KeyTable | None, request) -> NamedKey | ProxyError | None:
    """The key that sent ``request``, the refusal, or None where no key is needed (open door or open path)."""
    if ring is None or request.path in OPEN_PATHS:
        return None
    presented = bearer(request)
    if not presented:
        return MISSING
    k = ring.match(presented)
    if k is None:
        return WRONG
    if not k.active:
        return revoked(k)
    if k.scope != "*" and (k.scope == "metrics") != (request.path == METRICS_PATH):
        return wrong_scope(k, request.path)
    return k


def claimed(ring: KeyTable, request) -> str:
    """The name of the key a refused request presented ("-" when it matches none): a revoked or out-of-scope
    key is named in the audit, a wrong one is not."""
    k = ring.match(bearer(request))
    return k.name if k is not None else "-"


def error_code(body: bytes) -> str:
    """``error.code`` of an answer in OpenAI's error shape ("" when it is not one), for the audit entry."""
    import json
    try:
        code = json.loads(body).get("error", {}).get("code")
    except (ValueError, AttributeError, UnicodeDecodeError, RecursionError):
        return ""
    return code if isinstance(code, str) and len(code) <= 64 and code.isprintable() else ""


def refusal_headers(v: Verdict) -> dict:
    return {"Retry-After": str(max(1, int(v.retry_after_s + 0.999))), **v.headers}


def queue_priority(request, asked: int) -> int:
    """The admission queue's class of a request (lower first): what the body asked (``priority``), but never
    ahead of its key's class (keys/table.CLASSES): between tenants of the same standing a batch key's requests
    wait behind every interactive one, whatever they ask; the share itself is ``tenant``'s weight."""
    who = getattr(request, "caller", None)
    floor = CLASSES.index(who.klass) if who is not None and who.klass in CLASSES else 0
    return max(asked, floor)


def tenant(request) -> tuple[str, float]:
    """Who shares the box's capacity under overload, and with what weight (sharing.WaitQueue): the request's key
    and its class's weight; every request without a key is one tenant ("")."""
    who = getattr(request, "caller", None)
    if who is None:
        return "", 1.0
    return who.name, CLASS_WEIGHTS.get(who.klass, 1.0)
