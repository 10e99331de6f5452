"""appliance/install/rolling.py's pure parts: when the workers that stay have room for those going out, and the
[rollout] settings. (The rollout itself runs against real systemd: tests/faults/test_rollout_systemd.py.)"""
from __future__ import annotations

from appliance.install.rolling import Rollout, irreplaceable, room_for
from appliance.settings.schema import default


def b(name, role="decode", state="closed", inflight=0, streams=0, drained=""):
    return {"name": name, "role": role, "state": state, "inflight": inflight, "streams": streams, "drained": drained}


def test_room_when_the_others_can_take_the_streams():
    st = {"backends": [b("prefill-0", "prefill"), b("decode-0", inflight=3, streams=3), b("decode-1", inflight=2)],
          "admission": {"queue": 0}}
    assert room_for(st, ["decode-0"], per_worker=8) == ""
    assert room_for(st, ["prefill-0"], per_worker=8) == ""


def test_no_room_names_the_numbers():
    st = {"backends": [b("decode-0", inflight=7, streams=7), b("decode-1", inflight=5)], "admission": {"queue": 0}}
    why = room_for(st, ["decode-0"], per_worker=8)
    assert "7 answers" in why and "room for 3" in why


def test_no_other_decoder_or_only_broken_or_drained_ones():
    for other in (b("decode-1", state="open"), b("decode-1", drained="rollout"), b("prefill-1", "prefill")):
        st = {"backends": [b("decode-0"), other]}
        assert "no other worker can serve answers" in room_for(st, ["decode-0"], per_worker=8)


def test_a_queue_in_the_proxy_means_the_box_is_at_its_ceiling():
    st = {"backends": [b("decode-0"), b("decode-1")], "admission": {"queue": 4}}
    assert "4 requests wait" in room_for(st, ["decode-0"], per_worker=8)


def test_settings_come_from_the_rollout_section():
    ro = Rollout.from_settings({"rollout": {"batch": 2, "drain_timeout_s": 5.0, "ready_timeout_s": 30.0,
                                            "capacity_wait_s": 0.0}}, force=True)
    assert (ro.batch, ro.drain_timeout_s, ro.ready_timeout_s, ro.capacity_wait_s, ro.force) == (2, 5.0, 30.0, 0.0, True)
    assert Rollout.from_settings({}).batch == default("rollout", "batch") == 1


def test_a_one_decoder_plan_cannot_wait_for_room_that_never_comes():
    st = {"backends": [b("prefill-0", "prefill"), b("decode-0")]}
    assert irreplaceable(st, ["decode-0"]) and not irreplaceable(st, ["prefill-0"])
    st = {"backends": [b("decode-0"), b("decode-1", state="open")]}       # down now, but it will be back
    assert not irreplaceable(st, ["decode-0"])
