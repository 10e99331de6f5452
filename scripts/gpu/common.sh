# Sourced by scripts/gpu/h200-*.sh (not run on its own): what every device-side run does the same way.
# The script sets R, C2, OUT, MODEL, ENGINE, EXTRA_ARGS and LOCAL_SMOKE first; this file gives it the device's
# environment, the clock and log, the staged Python tree, the processes it starts by name and pdctl.toml.

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_USE_FLASHINFER_SAMPLER=0
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 LMCACHE_TRACK_USAGE=false VLLM_NO_USAGE_STATS=1
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
log() { echo "[$(printf '%4d' "$(el)")s] $*" | tee -a "$OUT/run.log"; }
fits() { [ $(( $(el) + $1 )) -le "$BUDGET_S" ] || { log "SKIP $2: $(el) s used, ~$1 s needed, budget $BUDGET_S s"; return 1; }; }

# --- the Python tree (vLLM 0.26.0 + deps, lmcache 0.5.3, pdctl's few missing wheels) ------------------------
stage_tree() {  # wheel dir: unpack what a previous call staged (docs/gpu-run.md), install pdctl's wheels, $EV
  mkdir -p /tmp/stage; cp "$C2"/site.part.* /tmp/stage/ 2>/dev/null
  [ -f /tmp/stage/site.part.aa ] || { log "MISSING /tmp/stage/site.part.aa (machine went cold: stage c1 again)"; exit 3; }
  if [ ! -f /tmp/site/.ok ]; then
    rm -rf /tmp/site; mkdir -p /tmp/site; cat /tmp/stage/site.part.* | xz -dc -T0 | tar -x -C /tmp/site || exit 4
    touch /tmp/site/.ok
  fi
  if [ ! -f /tmp/site-lmc/.ok ]; then mkdir -p /tmp/site-lmc; xz -dc "$C2/lmc.tar.xz" | tar -x -C /tmp/site-lmc && touch /tmp/site-lmc/.ok; fi
  if [ ! -f /tmp/pdctl-site/.ok ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/pdctl-site "$1"/*.whl \
      && touch /tmp/pdctl-site/.ok
  fi
  export PYTHONPATH=/tmp/pdctl-site:/tmp/site-lmc:/tmp/site:$R
  # an "engine venv" whose bin/ holds the entry points pdctl's plan names (no venv exists on the device)
  EV=/tmp/ev; mkdir -p $EV/bin
  printf '#!/bin/sh\nexec python3 -m vllm.entrypoints.cli.main "$@"\n' > $EV/bin/vllm
  printf '#!/bin/sh\nexec python3 -m lmcache.cli.main "$@"\n' > $EV/bin/lmcache
  printf '#!/bin/sh\nexec python3 -m appliance "$@"\n' > $EV/bin/pdctl
  chmod +x $EV/bin/*
}

# --- processes by name (PID[name]), stopped by PID ---------------------------------------------------------
declare -A PID=()
stop() {  # names...
  for n in "$@"; do [ -n "${PID[$n]:-}" ] && kill -TERM "${PID[$n]}" 2>/dev/null; done
  for n in "$@"; do p=${PID[$n]:-}; [ -z "$p" ] && continue
    for i in $(seq 1 60); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done; kill -KILL "$p" 2>/dev/null; unset "PID[$n]"; done
}
wait_url() {  # url seconds name pidname
  local t=$(date +%s)
  for i in $(seq 1 "$2"); do curl -sf "$1" >/dev/null 2>&1 && { log "$3 up after $(( $(date +%s) - t )) s"; return 0; }
    [ -n "${4:-}" ] && ! kill -0 "${PID[$4]}" 2>/dev/null && { log "$3 DIED"; return 1; }; sleep 1; done
  log "$3 not up after $2 s"; return 1
}

# --- the appliance's config ---------------------------------------------------------------------------------
pdctl_toml() {  # root gpus "[plan] lines" max_model_len l1_size_gb [further sections]: a fresh root's pdctl.toml
  rm -rf "$1"; mkdir -p "$1/etc/pdctl"
  { cat <<TOML
schema_version = 1
[install]
gpus = "$2"
engine = "$ENGINE"
model = "$MODEL"
engine_venv = "$EV"
venv = "$EV"
[plan]
served_model_name = "m"
extra_engine_args = $EXTRA_ARGS
$3
[workload]
max_model_len = $4
[kv_server]
l1_size_gb = $5
TOML
    if [ -n "${6:-}" ]; then printf '%s\n' "$6"; fi
  } > "$1/etc/pdctl/pdctl.toml"
}
