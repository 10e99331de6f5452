"""FleetPlan: node parsing, the router argv (checked by vllm-router 0.1.17's own argument parser), errors."""
from __future__ import annotations

import json

import pytest

from appliance import constants as C
from appliance.fleet.plan import FleetError, FleetPlan, Node, make_fleet_plan, parse_node


@pytest.mark.parametrize("spec,host,port,name", [
    ("10.0.0.5", "10.0.0.5", C.PROXY_PORT, ""),
    ("box-a.lan:9001", "box-a.lan", 9001, ""),
    ("[fd00::1]:9000", "fd00::1", 9000, ""),
    ("[fd00::2]", "fd00::2", C.PROXY_PORT, ""),
    ("west=192.168.7.2:9100", "192.168.7.2", 9100, "west"),
])
def test_parse_node_accepts(spec, host, port, name):
    n = parse_node(spec)
    assert (n.host, n.port, n.name) == (host, port, name)


def test_node_urls_bracket_ipv6_and_use_status_port():
    n = Node(host="fd00::1", port=9000, status_port=9001)
    assert n.url == "http://[fd00::1]:9000"
    assert n.status_url == f"http://[fd00::1]:9001{C.BOX_STATUS_PATH}"
    assert Node(host="a", port=9000).status_url == f"http://a:9000{C.BOX_STATUS_PATH}"
    tls = parse_node("secure=HTTPS://box-b.lan:9443/")
    assert (tls.scheme, tls.url, tls.label) == ("https", "https://box-b.lan:9443", "secure")
    assert tls.status_url == f"https://box-b.lan:9443{C.BOX_STATUS_PATH}"
    assert parse_node("http://10.0.0.5").url == "http://10.0.0.5:9000"


@pytest.mark.parametrize("spec,needle", [
    ("https://10.0.0.5:9000/v1", "without a path"),
    ("", "empty node"),
    ("box:0", "1..65535"),
    ("box:http", "1..65535"),
    ("fd00::1", "brackets"),
    ("[nothex]:9000", "not an IPv6"),
    ("bad_host!:9000", "not a host name"),
    ("bad name=10.0.0.1", "name"),
])
def test_parse_node_rejects_with_a_fix(spec, needle):
    with pytest.raises(FleetError) as e:
        parse_node(spec)
    assert needle in str(e.value)
    assert "--node" in str(e.value)


def test_router_argv_is_accepted_by_vllm_router_own_parser():
    """Every flag we emit must exist in the pinned router: parse the argv with vllm-router's parser."""
    launch = pytest.importorskip("vllm_router.launch_router")
    fp = make_fleet_plan(["10.0.0.1", "b=10.0.0.2:9001"], policy="cache_aware", listen="0.0.0.0:30123",
                         metrics="127.0.0.1:29123")
    ra = launch.parse_router_args(list(fp.router.argv))
    assert ra.worker_urls == ["http://10.0.0.1:9000", "http://10.0.0.2:9001"]
    assert ra.policy == "cache_aware"
    assert (ra.host, ra.port) == ("0.0.0.0", 30123)
    assert (ra.prometheus_host, ra.prometheus_port) == ("127.0.0.1", 29123)
    assert ra.health_check_endpoint == "/ready"
    assert ra.cb_failure_threshold == fp.router.cb_failures == 2
    assert ra.retry_max_retries == fp.router.retries
    assert ra.health_check_interval_secs == fp.router.health_interval_s
    assert ra.worker_startup_timeout_secs == 60
    assert (ra.balance_abs_threshold, ra.balance_rel_threshold) == (fp.router.balance_abs, fp.router.balance_rel) \
        == (64, 1.5)                        # emitted, not left to the router's defaults: how a full box spills
    assert not ra.vllm_pd_disaggregation   # PD stays inside each box
    ra._validate_router_args()


def test_plan_says_how_boxes_refuse_behind_the_router():
    """vllm-router 0.1.17 counts a 503 against the box's breaker, a 429 not (benchmarks/fleet_overload.py): the
    plan's reasons tell the operator to refuse with 429 on the boxes, and say how many attempts a request gets."""
    fp = make_fleet_plan(["a=10.0.0.1", "b=10.0.0.2"], balance_abs=3)
    why = " ".join(fp.reasons)
    assert "[admission] status = 429" in why and "up to 3 attempts" in why
    assert "more than 3 and 1.5x" in why
    argv = list(fp.router.argv)
    assert argv[argv.index("--balance-abs-threshold") + 1] == "3"


@pytest.mark.parametrize("policy", ["consistent_hash", "power_of_two", "round_robin"])
def test_other_policies_are_router_policies(policy):
    launch = pytest.importorskip("vllm_router.launch_router")
    fp = make_fleet_plan(["10.0.0.1"], policy=policy)
    assert launch.parse_router_args(list(fp.router.argv)).policy == policy
    assert any("only one box" in r for r in fp.reasons)


def test_json_roundtrip_and_bad_file_shape():
    fp = make_fleet_plan(["a=10.0.0.1", "b=10.0.0.2"])
    again = FleetPlan.from_json(json.loads(json.dumps(fp.to_json())))
    assert again == fp
    with pytest.raises(FleetError, match="not a pdctl fleet plan"):
        FleetPlan.from_json({"nodes": [{"port": 1}]}, where="x.json")
    with pytest.raises(FleetError, match="schema_version"):
        FleetPlan.from_json({**fp.to_json(), "schema_version": 7})


@pytest.mark.parametrize("kwargs,needle", [
    (dict(node_specs=[]), "at least one --node"),
    (dict(node_specs=["a", "a:9000"]), "given twice"),
    (dict(node_specs=["x=a", "x=b"]), "distinct name"),
    (dict(node_specs=["a"], policy="kv_aware"), "not one of"),
    (dict(node_specs=["a"], listen="box:30000"), "must be an IP address"),
    (dict(node_specs=["a"], listen="30000"), "HOST:PORT"),
    (dict(node_specs=["a"], metrics="0.0.0.0:30000"), "collides"),
    (dict(node_specs=["a"], retries=0), ">= 1"),
    (dict(node_specs=["a"], balance_rel=0.5), "balance_rel >= 1"),
    (dict(node_specs=["a"], balance_abs=-1), "balance_abs must be >= 0"),
])
def test_make_fleet_plan_rejects(kwargs, needle):
    with pytest.raises(FleetError, match=needle):
        make_fleet_plan(**kwargs)


@pytest.mark.parametrize("content", [None, "not a certificate\n"])
def test_fleet_status_names_a_ca_file_it_cannot_use(tmp_path, capsys, content):
    """``pdctl fleet status --ca-file``: a missing or non-PEM file is refused before any box is asked, naming the
    flag, the file and the fix."""
    from appliance.cli import main
    ca = tmp_path / "ca.pem"
    if content is not None:
        ca.write_text(content)
    rc = main(["fleet", "status", "--node", "https://127.0.0.1:1", "--ca-file", str(ca)])
    err = capsys.readouterr().err
    assert rc == 2 and f"--ca-file {ca}" in err and "cannot load it as PEM CA certificates" in err, err
