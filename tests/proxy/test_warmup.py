"""The KV warm-up (warmup.py): every worker gets one long request with a prompt nobody has seen once it is
admitted, consumers right after a producer stored it, and again after each re-admission. The real effect on
LMCache (heartbeats, no reaping while idle) is tests/real/test_worker_reap_cpu.py."""
from __future__ import annotations

import asyncio
import time

from .conftest import make_cfg

NEEDLE = "pdctl KV warm-up "


def warmups(engine) -> list:
    return [x for x in engine.log() if str(x["body"].get("prompt", "")).startswith(NEEDLE)]


async def until(pred, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(0.05)
    return False


async def test_every_worker_is_warmed_once_and_again_after_readmission(fresh, proxy_factory):
    e = fresh
    px = await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url, e["d1"].url], canary_interval_s=0.2))
    assert await until(lambda: all(px.server.status()["kv_warm"].values())), px.server.status()["kv_warm"]
    p, d0, d1 = warmups(e["p0"]), warmups(e["d0"]), warmups(e["d1"])
    assert len(d0) == 1 and len(d1) == 1, (len(d0), len(d1))
    assert len(p) == 3                          # itself, then a store before each consumer's retrieve
    prompts = [x["body"]["prompt"] for x in p]
    assert len(set(prompts)) == 3 and d0[0]["body"]["prompt"] in prompts and d1[0]["body"]["prompt"] in prompts
    assert all(len(x) > 1000 for x in prompts)  # longer than one LMCache chunk (256 tokens)
    await asyncio.sleep(1.0)
    assert len(warmups(e["d1"])) == 1            # warm stays warm
    e["d1"].mode("hang_all")                     # probes time out: the breaker opens (as while it restarts)
    assert await until(lambda: not px.server.status()["kv_warm"]["decode-1"])
    e["d1"].mode("ok")
    assert await until(lambda: px.server.status()["kv_warm"]["decode-1"])
    assert len(warmups(e["d1"])) == 2 and len(warmups(e["d0"])) == 1
