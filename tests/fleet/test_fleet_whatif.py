"""`pdctl fleet whatif`: N boxes of the seed's 1P2D A100 stack, from the twin's simulator."""
from __future__ import annotations

import json

import pytest

from appliance.cli import main
from appliance.fleet.plan import FleetError
from appliance.fleet.whatif import fleet_whatif, render_markdown


def test_more_boxes_carry_more_load_at_the_same_ttft():
    rows = {(r.boxes, r.rate): r for r in fleet_whatif([1, 2, 4], [10, 40], num_prompts=300)}
    assert rows[(4, 40)].gpus == 12 and rows[(1, 40)].gpus == 3
    one, four = rows[(1, 40)], rows[(4, 40)]
    assert four.delivered > 2 * one.delivered            # one box saturates; four keep up
    assert four.ttft_p95_s < 2.0 < one.ttft_p95_s
    assert rows[(1, 10)].ttft_p95_s < 2.0                  # the seed's 1P2D holds ~10 req/s (its own table: 8.5)
    text = render_markdown(list(rows.values()))
    assert "| 4 | 12 | 40 |" in text and "4 box(es): highest asked rate with TTFT p95 <= 2 s: 40 req/s" in text


def test_cli_json_and_bad_input(capsys):
    assert main(["fleet", "whatif", "--boxes", "1,2", "--rates", "5", "--num-prompts", "200", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["boxes"] for r in rows] == [1, 2]
    assert main(["fleet", "whatif", "--boxes", "two"]) == 2
    assert "comma-separated" in capsys.readouterr().err
    with pytest.raises(FleetError, match="num-prompts"):
        fleet_whatif([1], [5], num_prompts=10)
