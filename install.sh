#!/usr/bin/env bash
# pdctl installer: turns this box into a prefill/decode-disaggregated LLM server under systemd.
#
#   sudo ./install.sh [flags]            detect GPUs -> plan -> /etc/pdctl -> units -> start pd.target -> ready
#   sudo ./install.sh --simulate         the same with twin GPUs, twin engines and a twin KV server (no GPU needed)
#   sudo ./install.sh --uninstall [--purge]
#
# Flags (each also as an environment override, k3s style):
#   --simulate                INSTALL_PDCTL_SIMULATE=1      twin GPUs/engines/KV server; installs no GPU packages
#   --dry-run                 INSTALL_PDCTL_DRY_RUN=1       print the plan and the files it would write; change nothing
#   --no-start                INSTALL_PDCTL_NO_START=1      write and enable, but do not start pd.target
#   --gpus SPEC               INSTALL_PDCTL_GPUS            nvml | fake:4xH200 | twin:4xH200 | none | FILE.json | 0,1,2
#   --model NAME|DIR          INSTALL_PDCTL_MODEL           registry name or local model directory
#   --engine KIND             INSTALL_PDCTL_ENGINE          vllm (GPU, default) | vllm-cpu | twin
#   --prefill N / --decode M  INSTALL_PDCTL_PREFILL/_DECODE worker counts (default: planned by the twin)
#   --both N                  INSTALL_PDCTL_BOTH            kv_both workers (soft roles; default: planned)
#   --tp K                    INSTALL_PDCTL_TP              tensor-parallel size per worker (default: smallest that fits)
#   --policy P                INSTALL_PDCTL_POLICY          adaptive (default) | pdctl | round-robin
#   --max-model-len N         INSTALL_PDCTL_MAX_MODEL_LEN   vLLM --max-model-len
#   --served-model-name S     INSTALL_PDCTL_SERVED_MODEL_NAME  the name clients put in "model"
#   --engine-version V        INSTALL_PDCTL_ENGINE_VERSION  engine version from the flag table
#   --engine-venv DIR         INSTALL_PDCTL_ENGINE_VENV     use an existing venv holding vllm + lmcache
#   --uninstall [--purge]     INSTALL_PDCTL_UNINSTALL=1     remove units, user, venv (--purge, INSTALL_PDCTL_PURGE=1:
#                                                           also /etc/pdctl and state)
# Other overrides:
#   INSTALL_PDCTL_PREFIX      where pdctl's venv goes (default /opt/pdctl)
#   INSTALL_PDCTL_WHEELHOUSE  install Python packages only from this directory (offline hosts, CI)
#   INSTALL_PDCTL_SKIP_ENGINES=1  do not install vllm/lmcache (they are already in --engine-venv)

main() {
  set -euo pipefail
  local here; here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  local prefix=${INSTALL_PDCTL_PREFIX:-/opt/pdctl}
  local simulate=${INSTALL_PDCTL_SIMULATE:-0} dry=${INSTALL_PDCTL_DRY_RUN:-0} nostart=${INSTALL_PDCTL_NO_START:-0}
  local uninstall=${INSTALL_PDCTL_UNINSTALL:-0} purge=${INSTALL_PDCTL_PURGE:-0}
  local tp=${INSTALL_PDCTL_TP:-} policy=${INSTALL_PDCTL_POLICY:-} mml=${INSTALL_PDCTL_MAX_MODEL_LEN:-}
  local served=${INSTALL_PDCTL_SERVED_MODEL_NAME:-}
  local gpus=${INSTALL_PDCTL_GPUS:-} model=${INSTALL_PDCTL_MODEL:-} engine=${INSTALL_PDCTL_ENGINE:-}
  local prefill=${INSTALL_PDCTL_PREFILL:-} decode=${INSTALL_PDCTL_DECODE:-} both=${INSTALL_PDCTL_BOTH:-}
  local engver=${INSTALL_PDCTL_ENGINE_VERSION:-} engvenv=${INSTALL_PDCTL_ENGINE_VENV:-}
  local wheelhouse=${INSTALL_PDCTL_WHEELHOUSE:-} skip_engines=${INSTALL_PDCTL_SKIP_ENGINES:-0}
  while [ $# -gt 0 ]; do
    case "$1" in
      --simulate) simulate=1 ;;
      --dry-run) dry=1 ;;
      --no-start) nostart=1 ;;
      --uninstall) uninstall=1 ;;
      --purge) purge=1 ;;
      --gpus) gpus=${2:?--gpus needs a value}; shift ;;
      --model) model=${2:?--model needs a value}; shift ;;
      --engine) engine=${2:?--engine needs a value}; shift ;;
      --prefill) prefill=${2:?--prefill needs a value}; shift ;;
      --decode) decode=${2:?--decode needs a value}; shift ;;
      --both) both=${2:?--both needs a value}; shift ;;
      --tp) tp=${2:?--tp needs a value}; shift ;;
      --policy) policy=${2:?--policy needs a value}; shift ;;
      --max-model-len) mml=${2:?--max-model-len needs a value}; shift ;;
      --served-model-name) served=${2:?--served-model-name needs a value}; shift ;;
      --engine-version) engver=${2:?--engine-version needs a value}; shift ;;
      --engine-venv) engvenv=${2:?--engine-venv needs a value}; shift ;;
      -h|--help) sed -n '2,/^$/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
      *) fatal 2 "unknown flag $1 (see --help)" ;;
    esac
    shift
  done

  [ "$(id -u)" -eq 0 ] || fatal 2 "must run as root (it writes /etc/pdctl, systemd units and creates the pdctl user): sudo $0"

  if [ "$uninstall" = 1 ]; then
    uninstall "$prefix" "$purge"
    return 0
  fi

  # --- preflight -------------------------------------------------------------------------------
  local py; py=$(command -v python3 || true)
  [ -n "$py" ] || fatal 2 "python3 not found: install Python >= 3.10 (apt-get install python3 python3-venv)"
  "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || fatal 2 "Python >= 3.10 needed, found $("$py" -V 2>&1)"
  "$py" -c 'import venv, ensurepip' 2>/dev/null || fatal 2 "python3 venv support missing: apt-get install python3-venv"
  local sysstate; sysstate=$(systemctl is-system-running 2>/dev/null || true)
  case "$sysstate" in
    running|degraded|starting) info "systemd is $sysstate" ;;
    *) [ "$dry" = 1 ] || fatal 2 "systemd is not running (systemctl is-system-running: ${sysstate:-no answer}); pdctl needs systemd as init. Try 'pdctl demo' without systemd" ;;
  esac
  if [ "$simulate" != 1 ] && [ -z "$gpus" ] && [ "${engine:-vllm}" = vllm ]; then
    [ -r /proc/driver/nvidia/version ] || fatal 2 "no NVIDIA GPU driver found (/proc/driver/nvidia/version missing). To try pdctl without GPUs: sudo $0 --simulate"
  fi

  # --- pdctl into its venv ------------------------------------------------------------------------
  local pipopts=(--disable-pip-version-check -q)
  [ -n "$wheelhouse" ] && pipopts+=(--no-index --find-links "$wheelhouse")
  if [ ! -x "$prefix/bin/python" ]; then
    info "creating virtual environment $prefix"
    "$py" -m venv "$prefix"
  fi
  info "installing pdctl into $prefix"
  local piplog; piplog=$(mktemp)
  if ! "$prefix/bin/python" -m pip install "${pipopts[@]}" "$here" >"$piplog" 2>&1; then
    grep -v '^WARNING: Location' "$piplog" | tail -40 >&2
    rm -f "$piplog"
    fatal 1 "pip could not install pdctl into $prefix (its output is above)"
  fi
  rm -f "$piplog"
  "$prefix/bin/python" -c 'import appliance' || fatal 1 "pdctl did not install into $prefix (see the pip output above)"
  ln -sf "$prefix/bin/pdctl" /usr/local/bin/pdctl

  # --- engines ----------------------------------------------------------------------------------
  if [ "$simulate" = 1 ] || [ "$engine" = twin ]; then
    info "simulation: no GPU packages installed (twin engines and KV server come with pdctl)"
  elif [ "$skip_engines" = 1 ]; then
    info "engines: using ${engvenv:-$prefix} as is (INSTALL_PDCTL_SKIP_ENGINES=1)"
  else
    local kind=gpu; [ "$engine" = vllm-cpu ] && kind=cpu
    "$here/scripts/install-engines.sh" "$kind" "${engvenv:-$prefix}"
  fi

  # --- the rest is pdctl install: detect -> plan -> config -> units -> user -> start -> ready ---------
  local args=(install --venv "$prefix")
  [ "$simulate" = 1 ] && args+=(--simulate)
  [ "$dry" = 1 ] && args+=(--dry-run)
  [ "$nostart" = 1 ] && args+=(--no-start)
  [ -n "$gpus" ] && args+=(--gpus "$gpus")
  [ -n "$model" ] && args+=(--model "$model")
  [ -n "$engine" ] && args+=(--engine "$engine")
  [ -n "$prefill" ] && args+=(--prefill "$prefill")
  [ -n "$decode" ] && args+=(--decode "$decode")
  [ -n "$both" ] && args+=(--both "$both")
  [ -n "$tp" ] && args+=(--tp "$tp")
  [ -n "$policy" ] && args+=(--policy "$policy")
  [ -n "$mml" ] && args+=(--max-model-len "$mml")
  [ -n "$served" ] && args+=(--served-model-name "$served")
  [ -n "$engver" ] && args+=(--engine-version "$engver")
  [ -n "$engvenv" ] && args+=(--engine-venv "$engvenv")
  info "pdctl ${args[*]}"
  "$prefix/bin/pdctl" "${args[@]}"
}

info() { echo "[INFO] $*"; }
warn() { echo "[WARN] $*" >&2; }
fatal() { local code=$1; shift; echo "[ERROR] $*" >&2; exit "$code"; }

uninstall() {
  local prefix=$1 purge=$2
  if [ -x "$prefix/bin/pdctl" ]; then
    if [ "$purge" = 1 ]; then "$prefix/bin/pdctl" uninstall --purge; else "$prefix/bin/pdctl" uninstall; fi
  else
    warn "$prefix/bin/pdctl not found: removing what is left by hand"
    systemctl stop pd.target 2>/dev/null || true
    rm -f /etc/systemd/system/pd.target /etc/systemd/system/pd-*.service
    rm -rf /etc/systemd/system/pd.target.wants
    systemctl daemon-reload 2>/dev/null || true
    id pdctl >/dev/null 2>&1 && userdel pdctl 2>/dev/null || true
    [ "$purge" = 1 ] && rm -rf /etc/pdctl /var/lib/pdctl /var/cache/pdctl
  fi
  rm -f /usr/local/bin/pdctl
  case "$prefix" in /opt/*) rm -rf "$prefix"; info "removed $prefix" ;; *) warn "kept $prefix (not under /opt)" ;; esac
  info "pdctl uninstalled"
}

main "$@"
