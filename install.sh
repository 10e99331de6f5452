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
#   --prefill N               INSTALL_PDCTL_PREFILL         dedicated prefill workers (default: planned by the twin)
#   --decode M                INSTALL_PDCTL_DECODE          dedicated decode workers (default: planned)
#   --both N                  INSTALL_PDCTL_BOTH            kv_both workers (soft roles; default: planned)
#   --tp K                    INSTALL_PDCTL_TP              tensor-parallel size per worker (default: smallest that fits)
#   --policy P                INSTALL_PDCTL_POLICY          adaptive (default) | pdctl | round-robin
#   --max-model-len N         INSTALL_PDCTL_MAX_MODEL_LEN   vLLM --max-model-len
#   --served-model-name S     INSTALL_PDCTL_SERVED_MODEL_NAME  the name clients put in "model"
#   --l1-size-gb G            INSTALL_PDCTL_L1_SIZE_GB      LMCache L1 in GiB (default: host RAM minus a reserve)
#   --config FILE             INSTALL_PDCTL_CONFIG          settings file (default /etc/pdctl/pdctl.toml)
#   --ready-timeout S         INSTALL_PDCTL_READY_TIMEOUT   bound on the wait for readiness (default 900 s)
#   --engine-version V        INSTALL_PDCTL_ENGINE_VERSION  engine version from the flag table
#   --engine-venv DIR         INSTALL_PDCTL_ENGINE_VENV     use an existing venv holding vllm + lmcache
#   --uninstall [--purge]     INSTALL_PDCTL_UNINSTALL=1     remove units, user, venv (--purge, INSTALL_PDCTL_PURGE=1:
#                                                           also /etc/pdctl and state)
#   --python PATH             INSTALL_PDCTL_PYTHON          interpreter for pdctl's venv (default: python3 on PATH,
#                                                           or a system one when the pdctl user cannot run that)
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
  local py=${INSTALL_PDCTL_PYTHON:-} l1=${INSTALL_PDCTL_L1_SIZE_GB:-} config=${INSTALL_PDCTL_CONFIG:-}
  local ready=${INSTALL_PDCTL_READY_TIMEOUT:-}
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
      --python) py=${2:?--python needs a value}; shift ;;
      --l1-size-gb) l1=${2:?--l1-size-gb needs a value}; shift ;;
      --config) config=${2:?--config needs a value}; shift ;;
      --ready-timeout) ready=${2:?--ready-timeout needs a value}; shift ;;
      -h|--help) sed -n '2,/^$/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
      *) fatal 2 "unknown flag $1 (see --help)" ;;
    esac
    shift
  done

  if [ "$uninstall" = 1 ]; then
    [ "$(id -u)" -eq 0 ] || fatal 2 "must run as root: sudo $0 --uninstall"
    uninstall "$prefix" "$purge"
    return 0
  fi

  # --- preflight, part 1 (no Python packages yet): every refusal at once, nothing written ---------
  local errs=()
  [ "$(id -u)" -eq 0 ] || errs+=("must run as root (it writes /etc/pdctl, systemd units and creates the pdctl user). Fix: sudo $0 $*")
  py=$(choose_python "$py" "$here") || errs+=("$py")
  local sysstate; sysstate=$(systemctl is-system-running 2>/dev/null || true)
  case "$sysstate" in
    running|degraded|starting) ;;
    *) [ "$dry" = 1 ] || errs+=("systemd is not running (systemctl is-system-running: ${sysstate:-no answer}); pdctl needs systemd as init. Fix: try 'pdctl demo' without systemd") ;;
  esac
  if [ "$simulate" != 1 ] && [ -z "$gpus" ] && [ "${engine:-vllm}" = vllm ]; then
    [ -r /proc/driver/nvidia/version ] || errs+=("no NVIDIA GPU driver found (/proc/driver/nvidia/version missing). Fix: without GPUs use sudo $0 --simulate (twin GPUs and engines), or --engine vllm-cpu --model DIR (real engines on CPU)")
  fi
  if [ ${#errs[@]} -gt 0 ]; then
    local e; for e in "${errs[@]}"; do echo "[ERROR] $e" >&2; done
    fatal 2 "preflight: ${#errs[@]} problem(s) above; nothing was written"
  fi
  info "preflight: root, $py ($("$py" -V 2>&1)), systemd ${sysstate:-not needed for --dry-run}"

  # --- pdctl into its venv (small); a venv the pdctl user cannot run is rebuilt ---------------------
  local created=0
  if [ -x "$prefix/bin/python" ] && ! "$prefix/bin/python" "$here/appliance/install/pathcheck.py" --interpreter >/dev/null 2>&1; then
    warn "$prefix was built from an interpreter the pdctl user cannot run: rebuilding it from $py"
    rm -rf "$prefix"
  fi
  if [ ! -x "$prefix/bin/python" ]; then
    info "creating virtual environment $prefix"
    "$py" -m venv "$prefix"
    created=1
  fi
  local pipopts=(--disable-pip-version-check -q)
  [ -n "$wheelhouse" ] && pipopts+=(--no-index --find-links "$wheelhouse")
  info "installing pdctl into $prefix"
  # pip builds a source tree in place (build/ and pdctl.egg-info, owned by root, left in the operator's checkout;
  # two installs from one tree at once would share them): it builds a private copy of what the package holds
  local piplog src; piplog=$(mktemp); src=$(mktemp -d)
  local part
  for part in pyproject.toml README.md appliance tui units etc; do
    cp -r "$here/$part" "$src/" || { rm -rf "$src" "$piplog"; fatal 1 "cannot copy $here/$part to $src to build pdctl"; }
  done
  if ! "$prefix/bin/python" -m pip install "${pipopts[@]}" "$src" >"$piplog" 2>&1; then
    grep -v '^WARNING: Location' "$piplog" | tail -40 >&2
    rm -rf "$piplog" "$src"
    fatal 1 "pip could not install pdctl into $prefix (its output is above)"
  fi
  rm -rf "$piplog" "$src"
  "$prefix/bin/python" -c 'import appliance' || fatal 1 "pdctl did not install into $prefix (see the pip output above)"

  # --- the pdctl install arguments (preflight, then the real run) ---------------------------------
  local args=(install --venv "$prefix")
  [ "$simulate" = 1 ] && args+=(--simulate)
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
  [ -n "$l1" ] && args+=(--l1-size-gb "$l1")
  [ -n "$config" ] && args+=(--config "$config")
  [ -n "$ready" ] && args+=(--ready-timeout "$ready")
  if [ "$dry" = 1 ]; then
    info "pdctl ${args[*]} --dry-run"
    "$prefix/bin/pdctl" "${args[@]}" --dry-run
    return
  fi

  # --- preflight, part 2 (pdctl's own checks: GPUs, ports, RAM, disk, paths), before anything heavy ---
  local pending=(); { [ "$simulate" = 1 ] || [ "$engine" = twin ] || [ "$skip_engines" = 1 ]; } || pending=(--engines-pending)
  local rc=0
  "$prefix/bin/pdctl" "${args[@]}" --preflight-only "${pending[@]}" || rc=$?
  if [ "$rc" -ne 0 ]; then
    if [ "$created" = 1 ]; then rm -rf "$prefix"; info "removed $prefix (created by this run)"; fi
    fatal "$rc" "preflight refused (above); nothing was installed"
  fi
  ln -sf "$prefix/bin/pdctl" /usr/local/bin/pdctl

  # --- engines ----------------------------------------------------------------------------------
  if [ "$simulate" = 1 ] || [ "$engine" = twin ]; then
    info "simulation: no GPU packages installed (twin engines and KV server come with pdctl)"
  elif [ "$skip_engines" = 1 ]; then
    info "engines: using ${engvenv:-$prefix} as is (INSTALL_PDCTL_SKIP_ENGINES=1)"
  else
    local kind=gpu; [ "$engine" = vllm-cpu ] && kind=cpu
    PDCTL_PYTHON="$py" "$here/scripts/install-engines.sh" "$kind" "${engvenv:-$prefix}"
  fi

  # --- the rest is pdctl install: detect -> plan -> config -> units -> user -> start -> ready ---------
  info "pdctl ${args[*]}"
  "$prefix/bin/pdctl" "${args[@]}"
}

info() { echo "[INFO] $*"; }
warn() { echo "[WARN] $*" >&2; }
fatal() { local code=$1; shift; echo "[ERROR] $*" >&2; exit "$code"; }

# The interpreter for pdctl's venv: the one asked for, or python3 on PATH; when the pdctl user cannot run
# that one (pyenv under /root: every unit would fail 203/EXEC), a system python3 that it can run.
# Prints the choice, or the refusal (exit 1) for the caller to collect.
choose_python() {
  local asked=$1 here=$2 cand
  local cands=()
  if [ -n "$asked" ]; then cands=("$asked"); else cands=("$(command -v python3 || true)" /usr/bin/python3 /usr/local/bin/python3); fi
  local why=""
  for cand in "${cands[@]}"; do
    [ -n "$cand" ] && [ -x "$cand" ] || continue
    if ! "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
      why="Python >= 3.10 needed, $cand is $("$cand" -V 2>&1). Fix: install python3 >= 3.10 and pass INSTALL_PDCTL_PYTHON"; continue
    fi
    if ! "$cand" -c 'import venv, ensurepip' 2>/dev/null; then
      why="$cand has no venv support. Fix: apt-get install python3-venv"; continue
    fi
    local out; if out=$("$cand" "$here/appliance/install/pathcheck.py" --interpreter 2>&1); then
      [ -z "$asked" ] && [ "$cand" != "${cands[0]}" ] && \
        echo "[WARN] ${cands[0]:-python3} cannot be run by the pdctl service user; using $cand" >&2
      echo "$cand"; return 0
    fi
    why=${out#\[ERROR\] }
    [ -n "$asked" ] && break
  done
  echo "${why:-python3 not found. Fix: apt-get install python3 python3-venv (Python >= 3.10)}"
  return 1
}

uninstall() {
  local prefix=$1 purge=$2
  if [ -x "$prefix/bin/pdctl" ]; then
    if [ "$purge" = 1 ]; then "$prefix/bin/pdctl" uninstall --purge; else "$prefix/bin/pdctl" uninstall; fi
  else
    warn "$prefix/bin/pdctl not found: removing what is left by hand"
    systemctl stop pd.target pd-proxy.socket 2>/dev/null || true
    rm -f /etc/systemd/system/pd.target /etc/systemd/system/pd-*.service /etc/systemd/system/pd-proxy.socket
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
