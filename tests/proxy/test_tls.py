"""TLS on the public port, in-process proxy in front of stand-in engines (real processes): the official openai
client and curl with the test CA, a client without the CA refused, weak TLS 1.2 ciphers refused, mutual TLS,
certificate rotation by reload under load (0 refused, 0 cut), and bad files named at start and at reload."""
from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import ssl
from dataclasses import replace

import httpx
import pytest
from openai import AsyncOpenAI

from appliance.keys import tls as T
from tests.tlscerts import CA

from .conftest import make_cfg


@pytest.fixture
def ca(tmp_path):
    return CA(tmp_path / "pki")


def tls_cfg(fresh, server, client_ca=None, **kw):
    return make_cfg([fresh["p0"].url], [fresh["d0"].url], tls_cert_file=str(server.cert),
                    tls_key_file=str(server.key), tls_client_ca_file=str(client_ca) if client_ca else "", **kw)


def https(px) -> str:
    return f"https://127.0.0.1:{px.server.public_port}"


def client_ctx(ca: CA, cert=None, **kw) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca.pem))
    if cert is not None:
        ctx.load_cert_chain(str(cert.cert), str(cert.key))
    for k, v in kw.items():
        setattr(ctx, k, v)
    return ctx


async def peer(port: int, ctx: ssl.SSLContext) -> tuple:
    """(TLS version, the server certificate's DER) of one new connection."""
    r, w = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="localhost")
    try:
        obj = w.get_extra_info("ssl_object")
        return obj.version(), obj.getpeercert(binary_form=True)
    finally:
        w.close()


async def curl(*args: str) -> tuple:
    p = await asyncio.create_subprocess_exec("curl", "-sS", "-m", "20", "-o", "-", "-w", "\n%{http_code}", *args,
                                             stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await p.communicate()
    body, _, code = out.decode().rpartition("\n")
    return p.returncode, code, body, err.decode()


async def test_openai_client_and_curl_with_the_ca_others_refused(fresh, proxy_factory, ca):
    px = await proxy_factory(tls_cfg(fresh, ca.issue("server")))
    ver, _ = await peer(px.server.public_port, client_ctx(ca))
    assert ver == "TLSv1.3"
    async with httpx.AsyncClient(verify=client_ctx(ca)) as http:
        client = AsyncOpenAI(base_url=https(px) + "/v1", api_key="none", http_client=http)
        stream = await client.chat.completions.create(model="tiny", stream=True, max_tokens=6,
                                                      messages=[{"role": "user", "content": "hello over TLS"}])
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text.strip(), "the streamed answer over TLS is empty"
    if shutil.which("curl"):
        rc, code, body, _ = await curl("--cacert", str(ca.pem), https(px) + "/v1/models")
        assert rc == 0 and code == "200" and json.loads(body)["data"], (rc, code, body)
        rc, code, _, err = await curl(https(px) + "/v1/models")          # no CA: the certificate is unknown
        assert rc == 60 and code == "000", (rc, code, err)
    # a client that trusts a stranger CA, plain HTTP, and TLS 1.2 with a CBC cipher without forward secrecy
    stranger = CA(ca.dir / "stranger", "stranger CA")
    with pytest.raises(ssl.SSLCertVerificationError):
        await peer(px.server.public_port, client_ctx(stranger))
    async with httpx.AsyncClient() as http:
        with pytest.raises(httpx.HTTPError):
            await http.get(f"http://127.0.0.1:{px.server.public_port}/health", timeout=5)
    weak = client_ctx(ca, maximum_version=ssl.TLSVersion.TLSv1_2)
    weak.set_ciphers("AES128-SHA")
    with pytest.raises((ssl.SSLError, ConnectionResetError)):     # no shared cipher: the handshake is refused
        await peer(px.server.public_port, weak)
    assert (await peer(px.server.public_port, client_ctx(ca, maximum_version=ssl.TLSVersion.TLSv1_2)))[0] \
        == "TLSv1.2"


async def test_mutual_tls_refuses_a_client_without_a_certificate(fresh, proxy_factory, ca):
    px = await proxy_factory(tls_cfg(fresh, ca.issue("server"), client_ca=ca.pem))
    good = ca.issue("alice", cn="alice", client=True)
    stranger = CA(ca.dir / "stranger", "stranger CA").issue("mallory", cn="mallory", client=True)
    url = https(px) + "/v1/models"
    async with httpx.AsyncClient(verify=client_ctx(ca, good)) as http:
        assert (await http.get(url, timeout=10)).status_code == 200
    for who in (None, stranger):
        async with httpx.AsyncClient(verify=client_ctx(ca, who)) as http:
            with pytest.raises(httpx.HTTPError):     # TLS 1.3: the alert arrives with the first read
                await http.get(url, timeout=10)
    # the proxy's own watchdog probe has no certificate: the refusal still proves the listener alive
    from appliance.proxy.lifecycle import own_health
    assert await own_health("127.0.0.1", px.server.public_port, 5.0, tls_on=True, mutual=True) == ""


async def test_rotation_by_reload_under_load_refuses_and_cuts_nothing(fresh, proxy_factory, ca):
    first = ca.issue("server")
    live = ca.dir / "live"
    live.mkdir()
    cert, key = live / "cert.pem", live / "key.pem"
    shutil.copy(first.cert, cert)
    shutil.copy(first.key, key)
    px = await proxy_factory(make_cfg([fresh["p0"].url], [fresh["d0"].url], tls_cert_file=str(cert),
                                      tls_key_file=str(key)))
    port = px.server.public_port
    _, der0 = await peer(port, client_ctx(ca))
    results = {"ok": 0, "errors": []}
    stop = asyncio.Event()

    async def one_client(fresh_conns: bool):
        body = {"model": "tiny", "prompt": "rotate me", "max_tokens": 8, "stream": True}
        async with httpx.AsyncClient(verify=client_ctx(ca), timeout=20) as http:
            while not stop.is_set():
                try:
                    if fresh_conns:
                        await http.aclose()
                        http = httpx.AsyncClient(verify=client_ctx(ca), timeout=20)
                    async with http.stream("POST", https(px) + "/v1/completions", json=body) as r:
                        raw = b"".join([c async for c in r.aiter_bytes()])
                    if r.status_code == 200 and raw.rstrip().endswith(b"data: [DONE]"):
                        results["ok"] += 1
                    else:
                        results["errors"].append(f"{r.status_code} {raw[-80:]!r}")
                except httpx.HTTPError as e:
                    results["errors"].append(f"{type(e).__name__}: {e} {e.__cause__!r} {e.__context__!r}")
            await http.aclose()

    async def served_more(n: int) -> None:
        """Until the load has had ``n`` more whole answers (bounded): an order of events, not a duration."""
        goal, deadline = results["ok"] + n, asyncio.get_running_loop().time() + 60
        while results["ok"] < goal and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)

    load = [asyncio.create_task(one_client(i % 2 == 0)) for i in range(4)]
    await served_more(8)
    second = ca.issue("server-renewed")
    shutil.copy(second.cert, cert)
    shutil.copy(second.key, key)
    changes = px.server.reload(px.server.cfg)
    assert any("TLS on -> on" in c for c in changes), changes
    _, der1 = await peer(port, client_ctx(ca))
    await served_more(8)                     # fresh connections on the new certificate, kept ones on the old
    stop.set()
    await asyncio.gather(*load)
    assert der1 != der0 and hashlib.sha256(der1).digest() == second.fingerprint(), "the renewed one is not served"
    assert results["errors"] == [] and results["ok"] >= 16, results
    assert px.server.status()["tls"]["on"] is True


async def test_bad_files_named_at_start_and_a_bad_reload_keeps_the_old(fresh, proxy_factory, ca):
    a, b = ca.issue("a"), ca.issue("b")
    with pytest.raises(T.TlsError, match=r"tls_key_file = .*b\.key: this private key does not match"):
        await proxy_factory(make_cfg([fresh["p0"].url], [fresh["d0"].url], tls_cert_file=str(a.cert),
                                     tls_key_file=str(b.key)))
    px = await proxy_factory(tls_cfg(fresh, a))
    _, der0 = await peer(px.server.public_port, client_ctx(ca))
    with pytest.raises(ValueError, match="tls_cert_file = /nonexistent.pem: no such file"):
        px.server.reload(replace(px.server.cfg, tls_cert_file="/nonexistent.pem"))
    assert (await peer(px.server.public_port, client_ctx(ca)))[1] == der0
    # turning TLS off, or mutual TLS on, is not a reload: reported, the listener kept as it is
    changes = px.server.reload(replace(px.server.cfg, tls_cert_file="", tls_key_file=""))
    assert any("turning TLS off needs a restart" in c for c in changes), changes
    changes = px.server.reload(replace(px.server.cfg, tls_client_ca_file=str(ca.pem)))
    assert any("turning mutual TLS on needs a restart" in c for c in changes), changes
    assert (await peer(px.server.public_port, client_ctx(ca)))[1] == der0


async def test_fleet_status_reads_an_https_box_with_its_ca_and_refuses_without(fresh, proxy_factory, ca):
    """``pdctl fleet status`` on a box with TLS on (``--node https://...``): with the box's CA it reads health,
    readiness and the box's status over TLS; with only the system's CAs the box counts as down (never read in
    the clear)."""
    from appliance.fleet.plan import parse_node
    from appliance.fleet.status import box_view
    from appliance.wire.fetch import client_context, fetch
    px = await proxy_factory(tls_cfg(fresh, ca.issue("server"), public_status=True, api_key="sk-fleet-status"))
    node = parse_node(f"box=https://localhost:{px.server.public_port}")
    r = await fetch(node.url + "/health", tls=client_context(str(ca.pem)), timeout_s=30)
    assert r.status == 200, r.error
    seen = await asyncio.to_thread(box_view, node, "sk-fleet-status", 30.0, client_context(str(ca.pem)))
    assert seen.health == "ok" and seen.ready.split(":")[0] in ("ready", "not ready"), seen   # answered
    assert not seen.detail and seen.inflight is not None, seen     # its /pdctl/status read and understood
    blind = await asyncio.to_thread(box_view, node, "sk-fleet-status", 30.0)
    assert blind.health.startswith("down") and "CERTIFICATE_VERIFY_FAILED" in blind.health, blind
