"""Why a unit will not come up (install/readiness.failed_for_good), from systemd's unit properties: a program
systemd cannot start says its exit status whether the wait saw it restarting or only after systemd gave up (a
busy box reaches the start limit before the next poll)."""
from appliance.install.readiness import failed_for_good

SPAWN = {"ExecMainStatus": "203", "ExecMainCode": "1"}


def test_a_spawn_failure_names_its_exit_status_while_restarting_and_after_the_start_limit():
    restarting = failed_for_good({**SPAWN, "ActiveState": "activating", "SubState": "auto-restart",
                                  "NRestarts": "3"}, 2)
    assert "exit status 203" in restarting
    gave_up = failed_for_good({**SPAWN, "ActiveState": "failed", "Result": "exit-code", "NRestarts": "10"}, 0)
    assert "exit status 203" in gave_up and "will not restart it" in gave_up


def test_a_crash_is_not_called_a_spawn_failure_and_a_unit_still_starting_is_waited_for():
    crashed = failed_for_good({"ExecMainStatus": "1", "ExecMainCode": "1", "ActiveState": "failed",
                               "Result": "exit-code"}, 0)
    assert crashed == "it failed (exit-code) and systemd will not restart it"
    assert failed_for_good({"ActiveState": "activating", "SubState": "start", "NRestarts": "0"}, 0) is None
