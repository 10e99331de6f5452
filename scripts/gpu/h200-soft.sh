#!/bin/bash
# Device-side run (kind nvidia-h200, ONE GPU): soft roles (issue 16). Two kv_both vLLM 0.26.0 engines share the
# one H200 and one LMCache 0.5.3 MP server behind pdctl's adaptive proxy; then one engine with the LMCache
# connector against the same engine without it. Run from the repo root on the device after a previous call
# staged .gpu/c1/site.part.aa in /tmp/stage (see docs/gpu-run.md, "One H200: two kv_both engines").
#   PHASES="soft conn nokv" bash scripts/gpu/h200-soft.sh
# Phases:
#   soft  both-0 + both-1 (CUDA_VISIBLE_DEVICES=0 for both) + KV server + proxy (--config, adaptive):
#         s1d cold long prompts, default thresholds; s1 seed P50 (warm shared prefix) and s2 cold long prompts
#         (no shared prefix) with --aggregate-max-uncached $AGG; s3 the proxy restarted with
#         --aggregate-max-uncached 0 --split-idle-max-running 1000 (every request split)
#   conn  both-1 stopped; both-0 (LMCache connector, prefix caching on) benched directly on :8300
#   nokv  everything stopped; the same engine from a plan with kv_connector = false, benched the same way
#   one   everything stopped; pdctl's own default plan for the one GPU (no counts: what `install` would run) with
#         its KV server and the adaptive proxy on its defaults; the seed P50 profile at O_RATES straight to the
#         engine, through :9000, and straight again (A-B-A, other prompts of the same profile each time): what the
#         proxy costs on real hardware (issue 23's "TTFT p50 at 1 req/s within 10 % of one aggregated engine")
# The planner refuses two workers on one GPU, so the plan is made for fake:2xH200 and patched here: both
# workers get gpus [0] and CUDA_VISIBLE_DEVICES=0 (their --gpu-memory-utilization is MEM each).
# Everything it starts is stopped by PID; results are packed into $OUT/results.tgz after every step, so a
# run cut off at its time limit still returns what it measured.
set -u
R=$(pwd); C2=$R/.gpu/c2; OUT=${OUT:-/tmp/out}; RES=/tmp/res-soft; mkdir -p "$OUT"; rm -rf "$RES"; mkdir -p "$RES"
MODEL=$C2/model
PHASES=${PHASES:-soft conn nokv}; MEM=${MEM:-0.40}; BUDGET_S=${BUDGET_S:-570}
NUM=${NUM:-30}; S_RATES=${S_RATES:-2,5}; COLD_RATES=${COLD_RATES:-1,4}; COLD_NUM=${COLD_NUM:-16}; D_NUM=${D_NUM:-10}
C_RATES=${C_RATES:-2,5,10}; C_NUM=${C_NUM:-40}; AGG=${AGG:-2048}
O_RATES=${O_RATES:-1,2,5}; O_NUM=${O_NUM:-40}; O_MEM=${O_MEM:-0.85}
LOCAL_SMOKE=${LOCAL_SMOKE:-0}; ENGINE=vllm; NOKV_GPUS=nvml; EXTRA_ARGS='["--load-format", "dummy"]'
[ "$LOCAL_SMOKE" = 1 ] && { ENGINE=twin; EXTRA_ARGS='[]'; NOKV_GPUS=fake:1xH200; MODEL=${SMOKE_MODEL:-$R/../shared/tools/gpu-h200/model-llama8b-shape}; }
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
pack() { tar -czf /tmp/res-soft.tgz -C "$RES" . && mv /tmp/res-soft.tgz "$OUT/results.tgz"; }

if [ "$LOCAL_SMOKE" != 1 ]; then
  stage_tree "$R/.gpu/whl"
  log "tree ready: $(python3 -c 'import vllm, lmcache, importlib.metadata as m; print("vllm", vllm.__version__, "lmcache", m.version("lmcache"))' 2>&1 | tail -1)"
  { nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader; python3 -V; } > "$RES/device.txt" 2>&1
  python3 -m appliance detect --gpus nvml --json > "$RES/detect-1xH200.json" 2> "$RES/detect.err"
else
  EV=$(dirname "$(dirname "$(command -v python3)")"); export PYTHONPATH=$R
fi
PD="python3 -m appliance"

gpu_used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1; }
wait_gpu_below() {  # MiB
  [ "$LOCAL_SMOKE" = 1 ] && return 0
  for i in $(seq 1 60); do u=$(gpu_used); [ "${u:-0}" -lt "$1" ] && break; sleep 1; done; log "GPU memory used now ${u:-?} MiB"
}
trap 'stop proxy both-1 both-0 kv ${OW:-}; pack' EXIT
snap() {  # tag: every counter the report needs, at this instant
  curl -s 127.0.0.1:9001/pdctl/status > "$RES/$1-status.json" 2>/dev/null
  curl -s 127.0.0.1:9000/metrics > "$RES/$1-proxy.txt" 2>/dev/null
  curl -s 127.0.0.1:6080/metrics > "$RES/$1-lmcache.txt" 2>/dev/null
  for p in 8300 8301; do curl -s 127.0.0.1:$p/metrics > "$RES/$1-engine-$p.txt" 2>/dev/null; done
  pack
}
mkconf() {  # root, gpus, extra [plan] lines
  pdctl_toml "$1" "$2" "gpu_memory_utilization = $MEM"$'\n'"$3" 10000 32 $'[ports]\nproxy = 9000'
}
# the planner's plan, made for two GPUs, moved onto GPU 0 (both workers): gpus [0], CUDA_VISIBLE_DEVICES=0
one_gpu() {
  python3 - "$1" <<'PY'
import json, os, sys
p = sys.argv[1]; d = json.load(open(p))
for w in d["workers"]:
    w["gpus"] = [0]; w["env"]["CUDA_VISIBLE_DEVICES"] = "0"; w["gpu_uuids"] = w["gpu_uuids"][:1]
    w["cpus"] = list(range(os.cpu_count() or 1))
json.dump(d, open(p, "w"), indent=1, sort_keys=True)
PY
}
bench() {  # tag url seed rates num warmup [profile args...]
  local tag=$1 url=$2 seed=$3 rates=$4 num=$5 warm=$6; shift 6
  log "bench $tag: $url rates $rates x $num (warm-up $warm, seed $seed) $*"
  $PD bench --url "$url" --model m "$@" --rates "$rates" --num-prompts "$num" --warmup "$warm" --warmup-rate 5 \
     --warmup-pause 2 --cooldown 3 --tokenizer "$MODEL" --seed "$seed" ${BPLAN:+--plan "$BPLAN"} \
     --out "$RES/bench-$tag" --no-plots --json > "$RES/bench-$tag.json" 2> "$RES/bench-$tag.err"
  log "bench $tag rc=$? $(python3 -c "
import json
for s in json.load(open('$RES/bench-$tag.json')):
    print(f\"{s['request_rate']:g}/s: {s['completed']}/{s['num_prompts']} deliv {s['request_throughput']:.2f} TTFT p50 {s['p50_ttft_ms']:.0f} p95 {s['p95_ttft_ms']:.0f} TPOT {s['p50_tpot_ms']:.1f} hit {s.get('kv_hit_rate')}\", end=' | ')
" 2>&1 | tail -c 600)"
  pack
}
start_proxy() {  # extra args
  $PD proxy --config "$ROOT/etc/pdctl/pdctl.toml" --listen 127.0.0.1:9000 "$@" >> "$RES/soft-proxy.log" 2>&1 & PID[proxy]=$!
  wait_url 127.0.0.1:9000/ready 300 "proxy /ready ($*)" proxy
}

# --- soft: two kv_both engines on GPU 0 behind the adaptive proxy ----------------------------------------
if [[ " $PHASES " == *" soft "* || " $PHASES " == *" conn "* ]]; then
  ROOT=/tmp/root-soft; mkconf $ROOT fake:2xH200 "both = 2"
  $PD install --root $ROOT --dry-run > "$RES/plan-soft.txt" 2>&1 || { log "plan soft failed"; cat "$RES/plan-soft.txt"; exit 5; }
  PLAN=$ROOT/etc/pdctl/plan.json; one_gpu $PLAN; cp $PLAN "$RES/plan-soft.json"; BPLAN=$PLAN
  log "plan: $(grep -E '^  (both|KV|proxy)' "$RES/plan-soft.txt" | tr -s ' ' | tr '\n' ';')"
  $PD kvserver run --plan $PLAN > "$RES/soft-kv.log" 2>&1 & PID[kv]=$!
  $PD worker run both-0 --plan $PLAN > "$RES/soft-both-0.log" 2>&1 & PID[both-0]=$!
  # the second engine starts once the first is healthy: its memory profile then sees no other process
  # allocating or freeing on the GPU (vLLM sizes its KV cache from what it measures while profiling)
  wait_url 127.0.0.1:8300/health 400 both-0 both-0 || { tail -40 "$RES/soft-both-0.log"; exit 6; }
  log "GPU memory with both-0: $(gpu_used) MiB"
  $PD worker run both-1 --plan $PLAN > "$RES/soft-both-1.log" 2>&1 & PID[both-1]=$!
  wait_url 127.0.0.1:8301/health 400 both-1 both-1 || { tail -40 "$RES/soft-both-1.log"; exit 6; }
  log "GPU memory with both-0 + both-1: $(gpu_used) MiB"
  grep -h -E "KV cache size|Maximum concurrency|Available KV cache memory|Registered KV cache" \
    "$RES"/soft-both-*.log "$RES/soft-kv.log" 2>/dev/null | cut -c1-220 | tee -a "$OUT/run.log"
  start_proxy || exit 7
  snap s0
fi
if [[ " $PHASES " == *" soft "* ]]; then
  # s1d: the default thresholds on cold long prompts. The proxy estimates text prompts at chars/4 tokens;
  # this model's tokenizer makes ~2.0 chars per token, so a 7,869-token prompt is estimated at ~3,950 <= 4096
  fits 40 s1d && { bench s1d http://127.0.0.1:9000 10 2 "$D_NUM" 0 --input-len 7869 --prefix-len 0 --output-len 252; snap s1d; }
  # s1, s2: 4096 real tokens in the proxy's chars/4 units for this tokenizer (AGG, default 2048)
  if fits 100 s1; then
    stop proxy; start_proxy --aggregate-max-uncached "$AGG" || exit 7
    snap s1a
    bench s1 http://127.0.0.1:9000 11 "$S_RATES" "$NUM" 10 --profile seed-p50; snap s1
  fi
  fits 50 s2 && { bench s2 http://127.0.0.1:9000 12 "$COLD_RATES" "$COLD_NUM" 0 --input-len 7869 --prefix-len 0 --output-len 252; snap s2; }
  if fits 60 s3; then
    stop proxy; start_proxy --aggregate-max-uncached 0 --split-idle-max-running 1000 || exit 7
    snap s3a
    bench s3 http://127.0.0.1:9000 13 "$S_RATES" "$NUM" 0 --profile seed-p50; snap s3
  fi
fi
# --- conn: one engine with the LMCache connector, alone on the GPU ---------------------------------------
if [[ " $PHASES " == *" conn "* ]] && fits 80 conn; then
  # LMCache 0.5.3 keeps a stopped engine's KV cache mapped (measured: 101,567 MiB in use 60 s after both-1
  # stopped, 55,707 MiB with both-0 alone), so waiting for the memory to come back is pointless here
  stop both-1; sleep 5; log "GPU memory after stopping both-1: $(gpu_used) MiB"
  snap c0
  BPLAN=$PLAN bench conn http://127.0.0.1:8300 21 "$C_RATES" "$C_NUM" 10 --profile seed-p50; snap c1
fi
stop proxy both-1 both-0 kv
# --- nokv: the same engine, no KV connector ---------------------------------------------------------------
if [[ " $PHASES " == *" nokv "* ]] && fits 170 nokv; then
  wait_gpu_below 2000
  ROOT=/tmp/root-nokv; mkconf $ROOT "$NOKV_GPUS" "kv_connector = false"   # 1 GPU, no counts: the aggregated plan
  $PD install --root $ROOT --dry-run > "$RES/plan-nokv.txt" 2>&1 || { log "plan nokv failed"; cat "$RES/plan-nokv.txt"; exit 5; }
  PLAN=$ROOT/etc/pdctl/plan.json; one_gpu $PLAN; cp $PLAN "$RES/plan-nokv.json"; BPLAN=$PLAN
  $PD worker run both-0 --plan $PLAN > "$RES/nokv-both-0.log" 2>&1 & PID[both-0]=$!
  if wait_url 127.0.0.1:8300/health 400 "both-0 (no connector)" both-0; then
    grep -h -E "KV cache size|Maximum concurrency" "$RES/nokv-both-0.log" | cut -c1-220 | tee -a "$OUT/run.log"
    snap n0
    bench nokv http://127.0.0.1:8300 21 "$C_RATES" "$C_NUM" 10 --profile seed-p50; snap n1
  else tail -40 "$RES/nokv-both-0.log"; fi
  stop both-0
fi
# --- one: pdctl's default plan on the one GPU, through the proxy vs straight to its engine ---------------
if [[ " $PHASES " == *" one "* ]] && fits 240 one; then
  wait_gpu_below 2000
  ROOT=/tmp/root-one; MEM=$O_MEM mkconf $ROOT "$NOKV_GPUS" ""          # no counts: the planner's default family
  $PD install --root $ROOT --dry-run > "$RES/plan-one.txt" 2>&1 || { log "plan one failed"; cat "$RES/plan-one.txt"; exit 5; }
  PLAN=$ROOT/etc/pdctl/plan.json; cp $PLAN "$RES/plan-one.json"; BPLAN=$PLAN
  log "plan: $(grep -E '^  (both|prefill|decode|KV|proxy)|^plan:' "$RES/plan-one.txt" | tr -s ' ' | tr '\n' ';')"
  read -r OW OPORT < <(python3 -c "import json; w = json.load(open('$PLAN'))['workers']; print(w[0]['instance'], w[0]['port']) if len(w) == 1 else print('many', 0)")
  [ "$OW" = many ] && { log "the default plan has more than one worker on one GPU: not this phase"; exit 5; }
  $PD kvserver run --plan $PLAN > "$RES/one-kv.log" 2>&1 & PID[kv]=$!
  $PD worker run "$OW" --plan $PLAN > "$RES/one-$OW.log" 2>&1 & PID[$OW]=$!
  wait_url 127.0.0.1:$OPORT/health 400 "$OW" "$OW" || { tail -40 "$RES/one-$OW.log"; exit 6; }
  grep -h -E "KV cache size|Maximum concurrency" "$RES/one-$OW.log" | cut -c1-220 | tee -a "$OUT/run.log"
  start_proxy || exit 7
  snap o0
  bench one-direct-a http://127.0.0.1:$OPORT 31 "$O_RATES" "$O_NUM" 10 --profile seed-p50; snap o1
  bench one-proxy http://127.0.0.1:9000 32 "$O_RATES" "$O_NUM" 10 --profile seed-p50; snap o2
  fits 100 one-direct-b && { bench one-direct-b http://127.0.0.1:$OPORT 33 "$O_RATES" "$O_NUM" 10 --profile seed-p50; snap o3; }
  stop proxy "$OW" kv
fi
log "END"
