#!/usr/bin/env bash
# Screenshot of `pdctl demo` in a real terminal: tmux 120x40, capture-pane with colours, rendered to SVG by rich.
#   scripts/demo-screenshot.sh OUT.svg [SECONDS]
set -euo pipefail
out=${1:?usage: demo-screenshot.sh OUT.svg [SECONDS]}; wait_s=${2:-30}
here=$(cd "$(dirname "$0")/.." && pwd); py=$here/.venv/bin/python
sess=pdctl-shot-$$
tmux new-session -d -s "$sess" -x 120 -y 40 "cd $here && $py -m appliance demo --rate 3"
trap 'tmux send-keys -t "$sess" q 2>/dev/null; sleep 3; tmux kill-session -t "$sess" 2>/dev/null || true' EXIT
sleep "$wait_s"
tmux capture-pane -t "$sess" -e -p > /tmp/$sess.ansi
"$py" - "$out" /tmp/$sess.ansi <<'PY'
import sys
from rich.console import Console
from rich.text import Text
con = Console(record=True, width=120, file=open("/dev/null", "w"), force_terminal=True, color_system="truecolor")
con.print(Text.from_ansi(open(sys.argv[2]).read()), end="")
con.save_svg(sys.argv[1], title="pdctl demo (tmux 120x40)")
PY
echo "wrote $out"
