from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from servers import Endpoint  # noqa: E402

from appliance.plan import Plan  # noqa: E402


def make_plan(workers: dict, kv_port: int, proxy_port: int, internal_port: int, engine: str = "vllm",
              engine_version: str = "0.33.0") -> Plan:
    """A Plan (through its JSON form, as the lead's config stores it) pointing at the given ports."""
    return Plan.from_json({
        "mode": "disaggregated", "engine": engine, "engine_version": engine_version, "model": "tiny",
        "workers": [{"instance": inst, "role": inst.split("-")[0], "gpus": gpus, "port": port, "argv": ["x"],
                     "env": {}} for inst, (port, gpus) in workers.items()],
        "kv_server": {"kind": "lmcache", "zmq_port": 1, "http_port": kv_port, "l1_size_gb": 4, "argv": []},
        "proxy": {"host": "127.0.0.1", "port": proxy_port, "internal_port": internal_port},
        "reasons": [],
    })


@pytest.fixture
def endpoints():
    made: list[Endpoint] = []

    def make() -> Endpoint:
        e = Endpoint()
        made.append(e)
        return e
    yield make
    for e in made:
        e.close()
