"""`pdctl status` on a fleet front node lists every box (read over HTTP), next to or instead of a local plan."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from appliance.stack.twin_stack import start_twin_stack

REPO = Path(__file__).resolve().parents[2]


def pdctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def test_front_node_status_shows_each_box(tmp_path):
    st = start_twin_stack("fake:2xH200", "deepseek-v2-lite", workdir=tmp_path)
    try:
        front = tmp_path / "front"
        front.mkdir()
        r = pdctl("fleet", "plan", "--node", f"box-a=127.0.0.1:{st.plan.proxy.port}",
                  "--node", "box-b=127.0.0.1:9", "--out", str(front / "fleet.json"))
        assert r.returncode == 0, r.stderr
        (front / "pdctl.toml").write_text("schema_version = 1\n")
        r = pdctl("status", "--config", str(front / "pdctl.toml"))
        assert "box-a" in r.stdout and "box-b" in r.stdout, r.stdout + r.stderr
        assert r.returncode == 1, "box-b does not answer: the fleet is not all ready"
        line_a = next(ln for ln in r.stdout.splitlines() if "box-a" in ln)
        assert "ready" in line_a and "not ready" not in line_a
    finally:
        st.stop()


def test_front_node_with_a_broken_fleet_plan_or_key_file_says_which_file(tmp_path):
    """A fleet.json that does not load: exit 2 naming it (status and tui), no traceback. An unreadable API key
    file: a warning naming it, and the boxes are still read (here: none answers)."""
    (tmp_path / "pdctl.toml").write_text(f'schema_version = 1\n[proxy]\napi_key_file = "{tmp_path / "gone.key"}"\n')
    (tmp_path / "fleet.json").write_text("{not json")
    for cmd in (["status"], ["tui", "--screenshot", str(tmp_path / "s.svg")]):
        r = pdctl(*cmd, "--config", str(tmp_path / "pdctl.toml"))
        assert r.returncode == 2 and str(tmp_path / "fleet.json") in r.stderr, (cmd, r.stderr)
        assert "Traceback" not in r.stderr
    r = pdctl("fleet", "plan", "--node", "box-x=127.0.0.1:9", "--out", str(tmp_path / "fleet.json"))
    assert r.returncode == 0, r.stderr
    r = pdctl("status", "--config", str(tmp_path / "pdctl.toml"))
    assert r.returncode == 1 and "box-x" in r.stdout, r.stdout + r.stderr
    assert f"api_key_file {tmp_path / 'gone.key'}" in r.stderr and "Traceback" not in r.stderr
