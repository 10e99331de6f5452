#!/bin/bash
# Device-side run (kind nvidia-h200, ONE GPU) for the twin's held-out calibration (issue 17): one aggregated
# vLLM 0.26.0 engine from pdctl's own plan, benched straight on its port (no proxy), with the LMCache 0.5.3
# connector (phase conn: kv_both + one LMCache MP server) or without it (phase nokv: [plan] kv_connector =
# false). Each phase measures, on the same engine:
#   probe  single requests, cold prompts of 2,000 / 8,000 / 16,000 tokens, 64 out (TTFT vs prompt length,
#          decode step at batch 1 vs context): 3 prompts each at 0.5 req/s
#   p95    the seed's P95 profile: 12,000 shared + 3,840 unique = 15,840 in, 561 out (warm-up 4 prompts)
#   cold   a cold long prompt: 15,840 in, no shared prefix, 256 out
#   chat   a short chat: 1,024 in, no shared prefix, 200 out
# Run from the root of a pdctl tree on the device after a previous call staged c1/site.part.aa in /tmp/stage:
#   GPUDIR=/path/holding/c2+whl PHASES=conn BUDGET_S=560 bash scripts/gpu/h200-twin.sh
# (docs/gpu-run.md, "Twin calibration runs", has the exact calls). Everything it starts is stopped by PID;
# results are packed into $OUT/results.tgz after every step, so a run cut off at its limit returns what it measured.
# LOCAL_SMOKE=1 runs the same plumbing here with twin engines on fake GPUs (no device time).
set -u
R=$(pwd); GPUDIR=${GPUDIR:-$R/.gpu}; C2=$GPUDIR/c2; OUT=${OUT:-/tmp/out}; RES=/tmp/res-twin; mkdir -p "$OUT"
rm -rf "$RES"; mkdir -p "$RES"
MODEL=$C2/model
PHASES=${PHASES:-conn nokv}; BUDGET_S=${BUDGET_S:-560}; MEM=${MEM:-0.85}
P95_RATES=${P95_RATES:-1,2,4,8}; P95_NUM=${P95_NUM:-30}
COLD_RATES=${COLD_RATES:-0.5,1,2,3}; COLD_NUM=${COLD_NUM:-16}
CHAT_RATES=${CHAT_RATES:-5,10,20,40}; CHAT_NUM=${CHAT_NUM:-120}
PROBE_LENS=${PROBE_LENS-2000 8000 16000}   # empty: no probes
LOCAL_SMOKE=${LOCAL_SMOKE:-0}; ENGINE=vllm; GPUS=nvml; EXTRA_ARGS='["--load-format", "dummy"]'
[ "$LOCAL_SMOKE" = 1 ] && { ENGINE=twin; EXTRA_ARGS='[]'; GPUS=fake:1xH200; MODEL=${SMOKE_MODEL:?SMOKE_MODEL=model dir}; }
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
pack() { cp "$OUT/run.log" "$RES/" 2>/dev/null; tar -czf /tmp/res-twin.tgz -C "$RES" . && mv /tmp/res-twin.tgz "$OUT/results.tgz"; }

if [ "$LOCAL_SMOKE" != 1 ]; then
  stage_tree "$GPUDIR/whl"
  log "tree ready: $(python3 -c 'import vllm, importlib.metadata as m; print("vllm", vllm.__version__, "lmcache", m.version("lmcache"))' 2>&1 | tail -1)"
  { nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader; python3 -V; } > "$RES/device.txt" 2>&1
else
  EV=$(dirname "$(dirname "$(command -v python3)")"); export PYTHONPATH=$R
fi
PD="python3 -m appliance"

trap 'stop engine kv; pack' EXIT
snap() {  # tag: the engine's and the KV server's counters at this instant
  curl -s 127.0.0.1:8300/metrics > "$RES/$1-engine.txt" 2>/dev/null
  curl -s 127.0.0.1:6080/metrics > "$RES/$1-lmcache.txt" 2>/dev/null
  pack
}
bench() {  # tag seed rates num warmup profile-args...
  local tag=$1 seed=$2 rates=$3 num=$4 warm=$5; shift 5
  log "bench $tag: rates $rates x $num (warm-up $warm, seed $seed) $*"
  $PD bench --url http://127.0.0.1:8300 --model m "$@" --rates "$rates" --num-prompts "$num" --warmup "$warm" \
     --warmup-rate 2 --warmup-pause 1 --cooldown 2 --tokenizer "$MODEL" --seed "$seed" --plan "$PLAN" \
     --out "$RES/bench-$tag" --no-plots --json > "$RES/bench-$tag.json" 2> "$RES/bench-$tag.err"
  log "bench $tag rc=$? $(python3 -c "
import json
for s in json.load(open('$RES/bench-$tag.json')):
    print(f\"{s['request_rate']:g}/s: {s['completed']}/{s['num_prompts']} deliv {s['request_throughput']:.2f} TTFT p50 {s['p50_ttft_ms']:.0f} TPOT {s['p50_tpot_ms']:.1f}\", end=' | ')
" 2>&1 | tail -c 700)"
  snap "$tag"
}
phase() {  # name, extra [plan] lines
  local name=$1 root=/tmp/root-$1
  pdctl_toml "$root" "$GPUS" "gpu_memory_utilization = $MEM"$'\n'"$2" 20000 32
  $PD install --root "$root" --dry-run > "$RES/plan-$name.txt" 2>&1 || { log "plan $name failed"; cat "$RES/plan-$name.txt"; return 1; }
  PLAN=$root/etc/pdctl/plan.json; cp "$PLAN" "$RES/plan-$name.json"
  local w=$(python3 -c "import json;print(json.load(open('$PLAN'))['workers'][0]['instance'])")
  log "=== $name: worker $w; $(grep -E '^(aggregated|disaggregated)' "$RES/plan-$name.txt" | head -1)"
  if [ "$name" = conn ]; then $PD kvserver run --plan "$PLAN" > "$RES/$name-kv.log" 2>&1 & PID[kv]=$!; fi
  $PD worker run "$w" --plan "$PLAN" > "$RES/$name-engine.log" 2>&1 & PID[engine]=$!
  wait_url 127.0.0.1:8300/health 400 "$name engine" engine || { tail -40 "$RES/$name-engine.log"; stop engine kv; return 1; }
  grep -h -E "KV cache size|Maximum concurrency|Available KV cache memory|Registered KV cache|cudagraph|CUDA graph" \
    "$RES/$name-engine.log" "$RES/$name-kv.log" 2>/dev/null | cut -c1-200 | tail -8 | tee -a "$OUT/run.log"
  snap "$name-0"
  for L in $PROBE_LENS; do
    fits 25 "$name-probe$L" && bench "$name-probe$L" $((30 + L / 1000)) 0.5 3 0 --input-len "$L" --prefix-len 0 --output-len 64
  done
  fits 110 "$name-p95" && bench "$name-p95" 41 "$P95_RATES" "$P95_NUM" 4 --profile seed-p95
  fits 80 "$name-cold" && bench "$name-cold" 42 "$COLD_RATES" "$COLD_NUM" 0 --input-len 15840 --prefix-len 0 --output-len 256
  fits 60 "$name-chat" && bench "$name-chat" 43 "$CHAT_RATES" "$CHAT_NUM" 0 --input-len 1024 --prefix-len 0 --output-len 200
  stop engine kv
}
for p in $PHASES; do
  case $p in
    conn) phase conn "" ;;
    nokv) phase nokv "kv_connector = false" ;;
    *) log "unknown phase $p (conn | nokv)" ;;
  esac
done
log "END"
