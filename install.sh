#!/usr/bin/env bash
# pdctl installer — see README.md. The full installer lands with the installer issue; until then this
# script refuses to run rather than half-install anything. Use `pdctl install --root DIR --dry-run` to
# render the whole install tree without touching the system.
main() {
  set -euo pipefail
  echo "[ERROR] install.sh is not finished yet: use '.venv/bin/pdctl install --root /tmp/pdctl-root --dry-run --gpus fake:4xH200' to see what it will write" >&2
  exit 2
}
main "$@"
