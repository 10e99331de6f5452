"""[workload] sessions (issue 32): the planner ranks plan families on conversations (turn n+1 repeats turn n's
prompt and answer) when the operator says the traffic is chat, through the same `pdctl plan` an operator runs;
a contradictory setting is refused naming its keys."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from appliance.plan.families import plan_workload
from appliance.plan.inputs import Workload
from appliance.twin.simulator import Sessions
from appliance.twin.workloads import Workload as SimWorkload

REPO = Path(__file__).resolve().parents[2]


def _plan(tmp_path, workload: str, *args) -> subprocess.CompletedProcess:
    cfg = tmp_path / "pdctl.toml"
    cfg.write_text(f'schema_version = 1\n[install]\ngpus = "fake:2xH200"\nengine = "twin"\n[workload]\n{workload}\n')
    return subprocess.run([sys.executable, "-m", "appliance", "plan", "--config", str(cfg), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=600, stdin=subprocess.DEVNULL)


def test_the_workload_keys_make_the_conversation():
    """Turn 1 is the configured request; later turns add its answer and a message; the cold share is for
    single requests only."""
    s = plan_workload(Workload(sessions=True, input_len=9000, prefix_len=7000, output_len=300,
                               session_message_len=80, session_turns_min=2, session_turns_max=4,
                               session_think_s=3.0, cold_share=0.5))
    assert isinstance(s, Sessions)
    p = s.profile
    assert (p.system_len, p.first_len, p.answer_len, p.message_len) == (7000, 2000, 300, 80)
    assert (p.turns_min, p.turns_max, p.think_s) == (2, 4, 3.0)
    assert p.prompt_len(3) == 9000 + 2 * (300 + 80)
    assert isinstance(plan_workload(Workload()), SimWorkload)          # off by default: single requests


def test_pdctl_plan_ranks_families_on_conversations(tmp_path):
    r = _plan(tmp_path, "sessions = true", "--json")
    assert r.returncode == 0, r.stderr
    pred = json.loads(r.stdout)["predicted"]
    assert pred["workload"].startswith("conversations of 3-10 turns, 6000+1869 in first"), pred
    assert pred["goodput_req_s"] > 0 and pred["goodput_req_s"] <= pred["ceiling_req_s"], pred
    assert {row["family"] for row in pred["ranking"]} == {"2B", "1P1B", "1P1D"}


def test_contradictory_session_keys_are_refused_by_name(tmp_path):
    r = _plan(tmp_path, "sessions = true\nsession_turns_max = 2")
    assert r.returncode == 2
    assert "[workload] session_turns_max 2 is below session_turns_min 3" in r.stderr
    r = _plan(tmp_path, "sessions = true\nmax_model_len = 8000")
    assert r.returncode == 2 and "does not fit max_model_len 8000" in r.stderr, r.stderr
