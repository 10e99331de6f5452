#!/bin/bash
# Device-side run (kind nvidia-h200-x2): pdctl's own detect -> plan -> launcher -> proxy -> bench with real
# vLLM 0.26.0 + LMCache 0.5.3, for three configurations. Run from the repo root on the device after a
# previous call staged .gpu/c1/site.part.aa in /tmp/stage (see docs/gpu-run.md).
#   CONFIGS="pd nokv agg" RATES=1,2,5,10,20 NUM=60 bash scripts/gpu/h200-run.sh
# Everything it starts is stopped by PID at the end of each configuration; results land in $OUT.
set -u
R=$(pwd); C2=$R/.gpu/c2; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; MODEL=$C2/model
CONFIGS=${CONFIGS:-pd nokv agg}; RATES=${RATES:-1,2,5,10,20}; NUM=${NUM:-60}; WARM=${WARM:-20}
# LOCAL_SMOKE=1: exercise this script's plumbing here with twin engines on fake GPUs (no device time)
LOCAL_SMOKE=${LOCAL_SMOKE:-0}; GPUS=nvml; ENGINE=vllm; EXTRA_ARGS='["--load-format", "dummy"]'
[ "$LOCAL_SMOKE" = 1 ] && { GPUS=fake:2xH200; ENGINE=twin; EXTRA_ARGS='[]'; }
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
T0=$(date +%s.%N)   # this run's log has tenths of a second (common.sh's el and fits are not used here)
log() { echo "[$(python3 -c "import time;print(f'{time.time()-$T0:7.1f}s')")] $*" | tee -a "$OUT/run.log"; }

# --- the Python tree (vLLM 0.26.0 + deps, lmcache 0.5.3, pdctl's few missing wheels) ------------------------
if [ "$LOCAL_SMOKE" != 1 ]; then
  stage_tree "$R/.gpu/whl"
  log "tree ready: $(python3 -c 'import vllm, lmcache; print("vllm", vllm.__version__)' 2>&1 | tail -1)"
else
  EV=$(dirname "$(dirname "$(command -v python3)")"); export PYTHONPATH=$R
fi

# --- detect (real NVML) ---------------------------------------------------------------------------------
python3 -m appliance detect --gpus "$GPUS" --json > "$OUT/detect-2xH200.json" 2> "$OUT/detect.err" || { log "detect failed"; cat "$OUT/detect.err"; }
python3 -m appliance detect --gpus "$GPUS" | tee -a "$OUT/run.log"

PIDS=()
stop_all() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${PIDS[@]}"; do for i in $(seq 1 60); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done; kill -KILL "$p" 2>/dev/null; done
  PIDS=()
  for i in $(seq 1 60); do  # the next configuration needs the GPU memory back
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | sort -n | tail -1)
    [ "${used:-0}" -lt 2000 ] && break; sleep 1
  done
  log "stopped; max GPU memory used now ${used:-?} MiB"
}
trap stop_all EXIT

run_config() {  # name, extra toml lines
  local name=$1 extra=$2 root=/tmp/root-$1
  pdctl_toml "$root" "$GPUS" "$extra" 10000 64 $'[ports]\nproxy = 9000'
  python3 -m appliance install --root "$root" --dry-run > "$OUT/plan-$name.txt" 2>&1 || { log "plan $name failed"; cat "$OUT/plan-$name.txt"; return 1; }
  cp "$root/etc/pdctl/plan.json" "$OUT/plan-$name.json"
  local plan=$root/etc/pdctl/plan.json
  log "=== $name: $(grep -E '^(disaggregated|aggregated)' "$OUT/plan-$name.txt")"
  python3 -m appliance kvserver run --plan "$plan" > "$OUT/$name-kv.log" 2>&1 & PIDS+=($!)
  for w in $(python3 -c "import json;print(' '.join(w['instance'] for w in json.load(open('$plan'))['workers']))"); do
    python3 -m appliance worker run "$w" --plan "$plan" > "$OUT/$name-$w.log" 2>&1 & PIDS+=($!)
  done
  python3 -m appliance proxy --config "$root/etc/pdctl/pdctl.toml" --listen 127.0.0.1:9000 > "$OUT/$name-proxy.log" 2>&1 & PIDS+=($!)
  local t=$(date +%s)
  for i in $(seq 1 300); do curl -sf 127.0.0.1:9000/ready >/dev/null 2>&1 && break; sleep 1; done
  curl -sf 127.0.0.1:9000/ready >/dev/null 2>&1 || { log "$name not ready"; tail -30 "$OUT"/$name-*.log; stop_all; return 1; }
  log "$name ready after $(( $(date +%s) - t )) s"
  python3 -m appliance status --config "$root/etc/pdctl/pdctl.toml" --json > "$OUT/$name-status-before.json" 2>&1
  ( while sleep 5; do python3 -m appliance status --config "$root/etc/pdctl/pdctl.toml" --json 2>/dev/null | tr -d '\n'; echo; done ) \
      > "$OUT/$name-collector.jsonl" & local COL=$!
  # headless TUI screenshot taken while the sweep runs (live data, not an idle box)
  [ "${SHOT:-pd}" = "$name" ] && { python3 -m appliance tui --config "$root/etc/pdctl/pdctl.toml" \
      --screenshot "$OUT/tui-$name.svg" --size 160x48 --after "${SHOT_AFTER:-45}" > "$OUT/tui-$name.err" 2>&1 & }
  python3 -m appliance bench --url http://127.0.0.1:9000 --model m --input-len 7869 --prefix-len 6000 --output-len 252 \
     --rates "$RATES" --num-prompts "$NUM" --warmup "$WARM" --cooldown 3 --tokenizer "$MODEL" --plan "$plan" \
     --out "$OUT/bench-$name" --json > "$OUT/bench-$name.json" 2> "$OUT/bench-$name.err"
  log "bench $name rc=$?"
  kill $COL 2>/dev/null
  python3 -m appliance status --config "$root/etc/pdctl/pdctl.toml" --json > "$OUT/$name-status-after.json" 2>&1
  curl -s 127.0.0.1:6080/metrics > "$OUT/$name-lmcache-metrics.txt"
  for w in $(python3 -c "import json;print(' '.join(str(w['port']) for w in json.load(open('$plan'))['workers']))"); do
    curl -s 127.0.0.1:$w/metrics > "$OUT/$name-engine-$w-metrics.txt"; done
  curl -s 127.0.0.1:9000/metrics > "$OUT/$name-proxy-metrics.txt"
  stop_all
}

for c in $CONFIGS; do
  case $c in
    pd) run_config pd "" ;;
    nokv) run_config nokv "kv_connector = false" ;;
    agg) run_config agg "gpu_indices = [0]" ;;
    pdrr) run_config pdrr $'[proxy]\npolicy = "round-robin"' ;;
    nowait) run_config nowait $'[proxy]\nkv_wait_s = 0.0' ;;
  esac
done
log "END"
# only 8 files come back from $OUT: pack everything into one archive next to the log
tar -czf /tmp/results.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name run.log -delete && mv /tmp/results.tgz "$OUT/"
