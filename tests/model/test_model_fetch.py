"""``pdctl model fetch|path`` through the real CLI and the real huggingface_hub client, against a stand-in hub.

The stand-in (tests/fixtures/hubserver.py) exists only because the real hub is unreachable here; everything
on the client side is the product: the CLI, appliance/model/fetch.py and the installed huggingface_hub.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from appliance.settings import config
from appliance.model.fetch import (ModelFetchError, hub_id, is_local, local_snapshot, read_token,
                                   worker_env_for_snapshot)
from tests.fixtures.hubserver import HubServer, wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
_BIN = Path(sys.executable).parent / "pdctl"
PDCTL = [str(_BIN)] if _BIN.exists() else [sys.executable, "-m", "appliance.cli"]
TOKEN = "hf_pdctlTestToken0123456789abcdef"
MiB = 1024**2
WEIGHTS = "model.safetensors"
WEIGHTS_SIZE = 24 * MiB      # > huggingface_hub's 10 MiB read chunk, so a cut after 15 MiB leaves bytes to resume


# ---- fixtures -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """A small model repo: config, tokenizer-ish files, a sub folder, 24 MiB + 2 MiB of 'weights' (LFS)."""
    d = tmp_path_factory.mktemp("src")
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}))
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    (d / "extra").mkdir()
    (d / "extra" / "README.md").write_text("tiny test model\n")
    (d / WEIGHTS).write_bytes(os.urandom(WEIGHTS_SIZE))
    (d / "optimizer.bin").write_bytes(os.urandom(2 * MiB))
    return d


@pytest.fixture
def hub(src):
    h = HubServer()
    h.add_repo("pdtest/tiny", src)
    h.add_repo("pdtest/gated", src, token=TOKEN)
    h.start()
    yield h
    h.stop()


def _env(tmp_path: Path, endpoint: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PDCTL_", "HUGGINGFACE"))}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env.update(HOME=str(home), HF_ENDPOINT=endpoint,
               PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO_ROOT)])))
    return env


def pdctl(tmp_path: Path, endpoint: str, *args: str, config_file: Path | None = None, timeout: float = 120,
          **popen) -> subprocess.CompletedProcess:
    cfg = config_file or tmp_path / "absent.toml"
    return subprocess.run([*PDCTL, "model", *args, "--config", str(cfg)], capture_output=True, text=True,
                          env=_env(tmp_path, endpoint), cwd=tmp_path, timeout=timeout, **popen)


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def tree_digest(d: Path) -> dict:
    """Content of every file (the stand-in hub, like a git repo of a model, serves no dotfiles)."""
    return {p.relative_to(d).as_posix(): sha256(p) for p in sorted(d.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


def storage(cache: Path, repo: str) -> Path:
    return cache / ("models--" + repo.replace("/", "--"))


def marker(cache: Path, repo: str) -> Path:
    return storage(cache, repo) / ".pdctl-verified" / "main.json"


def partials(cache: Path) -> list:
    return sorted(str(p) for p in cache.rglob("*.incomplete"))


def resolves(hub: HubServer, since: int = 0) -> list:
    return [r for r in hub.requests[since:] if "/resolve/" in r.path]


# ---- fetch, progress, identical files, idempotent re-run, permissions -------------------------------------
def test_fetch_shows_progress_and_gives_identical_verified_files(hub, src, tmp_path):
    cache = tmp_path / "cache"
    t0 = time.monotonic()
    r = pdctl(tmp_path, hub.url, "fetch", "pdtest/tiny", "--cache-dir", str(cache))
    secs = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    snap = Path(r.stdout.strip())
    assert r.stdout.strip().count("\n") == 0, "stdout is the snapshot path alone"
    commit = hub.repos["pdtest/tiny"].commit
    assert snap == storage(cache, "pdtest/tiny") / "snapshots" / commit
    # progress: pdctl's [INFO] lines and huggingface_hub's own bars (written even though stderr is a pipe)
    assert f"[INFO] fetching pdtest/tiny@main from {hub.url} into {cache}" in r.stderr
    assert f"commit {commit}: 5 files" in r.stderr and "to download" in r.stderr
    assert "Fetching 5 files" in r.stderr and "100%" in r.stderr
    assert "[INFO] verified 5 files" in r.stderr
    assert tree_digest(snap) == tree_digest(src)
    assert marker(cache, "pdtest/tiny").is_file() and partials(cache) == []
    assert not (tmp_path / "home" / ".cache" / "huggingface").exists(), "nothing written outside the cache"
    assert all(not r.path.startswith("/api/agent") for r in hub.requests), "no telemetry side requests"
    # readable by the unprivileged service user: dirs a+rx, files a+r
    for p in [cache, *cache.rglob("*")]:
        if p.is_symlink():
            continue
        mode = stat.S_IMODE(p.lstat().st_mode)
        assert mode & (0o555 if p.is_dir() else 0o444) == (0o555 if p.is_dir() else 0o444), (p, oct(mode))
    # path: the same snapshot, offline (the hub's address is dead now)
    r2 = pdctl(tmp_path, "http://127.0.0.1:9", "path", "pdtest/tiny", "--cache-dir", str(cache))
    assert r2.returncode == 0 and r2.stdout.strip() == str(snap), r2.stderr
    assert local_snapshot("pdtest/tiny", "main", cache) == snap
    # a second fetch downloads nothing
    n = len(hub.requests)
    r3 = pdctl(tmp_path, hub.url, "fetch", "pdtest/tiny", "--cache-dir", str(cache))
    assert r3.returncode == 0 and r3.stdout.strip() == str(snap), r3.stderr
    assert "already fetched and verified" in r3.stderr
    assert resolves(hub, n) == []
    print(f"fetch of 26 MiB through the stand-in hub: {secs:.1f} s")


def test_connection_cut_mid_file_is_resumed_with_a_range_request(hub, src, tmp_path):
    cut = 15 * MiB
    hub.cut_once[("pdtest/tiny", WEIGHTS)] = cut
    cache = tmp_path / "cache"
    r = pdctl(tmp_path, hub.url, "fetch", "pdtest/tiny", "--cache-dir", str(cache))
    assert r.returncode == 0, r.stderr
    gets = [g for g in hub.gets(WEIGHTS)]
    assert gets[0].range is None and gets[0].sent == cut, gets
    resumed = [g for g in gets[1:] if g.range and g.range.startswith("bytes=") and not g.range.startswith("bytes=0-")]
    assert resumed and resumed[0].status == 206, gets
    start = int(resumed[0].range[len("bytes="):].rstrip("-"))
    assert 0 < start <= cut and resumed[0].sent == WEIGHTS_SIZE - start, "only the missing bytes came again"
    assert "Trying to resume download" in r.stderr
    assert sha256(Path(r.stdout.strip()) / WEIGHTS) == sha256(src / WEIGHTS)


def test_killed_fetch_is_never_used_and_a_rerun_fetches_only_what_is_missing(hub, src, tmp_path):
    hub.stall[("pdtest/tiny", WEIGHTS)] = 12 * MiB
    cache = tmp_path / "cache"
    cmd = [*PDCTL, "model", "fetch", "pdtest/tiny", "--cache-dir", str(cache), "--config", str(tmp_path / "x.toml")]
    err = tmp_path / "killed.err"
    with open(err, "wb") as fh:
        proc = subprocess.Popen(cmd, env=_env(tmp_path, hub.url), stdout=subprocess.DEVNULL, stderr=fh)
    try:
        small = [f for f in hub.repos["pdtest/tiny"].files if f != WEIGHTS]
        snapdir = storage(cache, "pdtest/tiny") / "snapshots" / hub.repos["pdtest/tiny"].commit
        assert wait_for(lambda: hub.stalled.is_set() and all((snapdir / f).exists() for f in small), 30), \
            err.read_text()
    finally:
        proc.send_signal(signal.SIGKILL)      # power cut / OOM kill: no cleanup code runs
        proc.wait(10)
    assert not marker(cache, "pdtest/tiny").exists()
    r = pdctl(tmp_path, hub.url, "path", "pdtest/tiny", "--cache-dir", str(cache))
    assert r.returncode == 1 and "not fetched" in r.stderr and "pdctl model fetch pdtest/tiny" in r.stderr
    assert local_snapshot("pdtest/tiny", "main", cache) is None
    left = partials(cache)          # the partial blob the killed run left (huggingface_hub >= 1 cannot reuse it)
    hub.stall.clear()
    hub.release.set()
    n = len(hub.requests)
    r = pdctl(tmp_path, hub.url, "fetch", "pdtest/tiny", "--cache-dir", str(cache))
    assert r.returncode == 0, r.stderr
    assert f"{WEIGHTS_SIZE / MiB:,.1f} MiB to download" in r.stderr, "finished files are kept, not fetched again"
    assert {Path(q.path).name for q in resolves(hub, n)} == {WEIGHTS}
    assert partials(cache) == [] and all(not Path(p).exists() for p in left)
    assert tree_digest(Path(r.stdout.strip())) == tree_digest(src)


def test_corrupted_download_is_deleted_and_never_marked(hub, src, tmp_path):
    hub.corrupt.add(("pdtest/tiny", WEIGHTS))
    cache = tmp_path / "cache"
    r = pdctl(tmp_path, hub.url, "fetch", "pdtest/tiny", "--cache-dir", str(cache))
    assert r.returncode == 2, r.stderr
    good = sha256(src / WEIGHTS)
    assert f"{WEIGHTS}: downloaded file has sha256" in r.stderr and good in r.stderr and "deleted" in r.stderr
    assert not (storage(cache, "pdtest/tiny") / "blobs" / good).exists()
    assert not marker(cache, "pdtest/tiny").exists() and partials(cache) == []
    hub.corrupt.clear()
    r = pdctl(tmp_path, hub.url, "fetch", "pdtest/tiny", "--cache-dir", str(cache))
    assert r.returncode == 0, r.stderr
    assert sha256(Path(r.stdout.strip()) / WEIGHTS) == good


# ---- token -------------------------------------------------------------------------------------------------
def _token_config(tmp_path: Path, token: str, mode: int = 0o600) -> tuple[Path, Path]:
    tok = tmp_path / "hf-token"
    tok.write_text(token + "\n")
    os.chmod(tok, mode)
    cfg = tmp_path / "pdctl.toml"
    cfg.write_text(f'schema_version = 1\n\n[model]\nhf_token_file = "{tok}"\ncache_dir = "{tmp_path / "cache"}"\n')
    return tok, cfg


def _assert_no_secret(r: subprocess.CompletedProcess, cache: Path, secret: str) -> None:
    assert secret not in r.stdout and secret not in r.stderr
    for p in cache.rglob("*") if cache.exists() else []:
        if p.is_file() and p.stat().st_size < MiB:
            assert secret.encode() not in p.read_bytes(), p


def test_gated_repo_with_the_token_file_works_and_the_token_is_never_shown(hub, src, tmp_path):
    tok, cfg = _token_config(tmp_path, TOKEN)
    r = pdctl(tmp_path, hub.url, "fetch", "pdtest/gated", config_file=cfg)
    assert r.returncode == 0, r.stderr
    assert tree_digest(Path(r.stdout.strip())) == tree_digest(src)
    gated = [q for q in hub.requests if "pdtest/gated" in q.path]
    assert gated and all(q.token_ok is True for q in gated), "every request to the gated repo carried the token"
    _assert_no_secret(r, tmp_path / "cache", TOKEN)
    assert set(worker_env_for_snapshot()) == {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"}


def test_gated_repo_without_a_token_names_the_token_file_key(hub, tmp_path):
    r = pdctl(tmp_path, hub.url, "fetch", "pdtest/gated", "--cache-dir", str(tmp_path / "cache"))
    assert r.returncode == 2
    assert "pdtest/gated is gated" in r.stderr and "[model] hf_token_file" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not marker(tmp_path / "cache", "pdtest/gated").exists()
    assert all(q.token_ok is None for q in hub.requests), "no token sent from HF_TOKEN or ~/.cache"


def test_wrong_token_is_rejected_clearly_and_not_echoed(hub, tmp_path):
    wrong = "hf_wrongWrongWrong0123456789"
    tok, cfg = _token_config(tmp_path, wrong)
    r = pdctl(tmp_path, hub.url, "fetch", "pdtest/gated", config_file=cfg)
    assert r.returncode == 2
    assert "rejected the token" in r.stderr and "[model] hf_token_file" in r.stderr, r.stderr
    _assert_no_secret(r, tmp_path / "cache", wrong)
    assert not marker(tmp_path / "cache", "pdtest/gated").exists()


def test_token_file_readable_by_others_is_refused_before_any_request(hub, tmp_path):
    tok, cfg = _token_config(tmp_path, TOKEN, mode=0o644)
    r = pdctl(tmp_path, hub.url, "fetch", "pdtest/gated", config_file=cfg)
    assert r.returncode == 2
    assert f"chmod 600 {tok}" in r.stderr and "0644" in r.stderr, r.stderr
    assert hub.requests == []
    _assert_no_secret(r, tmp_path / "cache", TOKEN)
    # the flag overrides the settings file, with the same check
    r = pdctl(tmp_path, hub.url, "fetch", "pdtest/gated", "--token-file", str(tmp_path / "absent-token"),
              config_file=cfg)
    assert r.returncode == 2 and "absent-token: cannot read" in r.stderr, r.stderr


def test_read_token_rules(tmp_path):
    assert read_token("") is None and read_token(None) is None
    p = tmp_path / "t"
    p.write_text("  abc \n")
    p.chmod(0o600)
    assert read_token(p) == "abc"
    p.chmod(0o640)
    with pytest.raises(ModelFetchError, match=f"chmod 600 {p}"):
        read_token(p)
    p.write_text("\n")
    p.chmod(0o400)
    with pytest.raises(ModelFetchError, match="empty"):
        read_token(p)
    with pytest.raises(ModelFetchError, match="not a regular file"):
        read_token(tmp_path)


# ---- missing repo / revision / hub ----------------------------------------------------------------------------
def test_missing_repo_revision_or_hub_fail_clearly_with_nothing_written(hub, tmp_path):
    cache = tmp_path / "cache"
    r = pdctl(tmp_path, hub.url, "fetch", "pdtest/nope", "--cache-dir", str(cache))
    assert r.returncode == 2 and "pdtest/nope not found on " + hub.url in r.stderr, r.stderr
    assert not storage(cache, "pdtest/nope").exists()
    r = pdctl(tmp_path, hub.url, "fetch", "pdtest/tiny", "--revision", "v9", "--cache-dir", str(cache))
    assert r.returncode == 2 and "has no revision 'v9'" in r.stderr and "[model] revision" in r.stderr, r.stderr
    assert not (storage(cache, "pdtest/tiny") / "snapshots").exists()
    r = pdctl(tmp_path, "http://127.0.0.1:9", "fetch", "pdtest/tiny", "--cache-dir", str(cache))
    assert r.returncode == 2 and "cannot reach the hub at http://127.0.0.1:9" in r.stderr, r.stderr
    assert "HF_ENDPOINT" in r.stderr
    assert "Traceback" not in r.stderr
    r = pdctl(tmp_path, hub.url, "path", "pdtest/nope", "--cache-dir", str(cache))
    assert r.returncode == 1 and "not fetched" in r.stderr


# ---- disk full ------------------------------------------------------------------------------------------------
def _in_tmpfs(tmp_path: Path, endpoint: str, size: str, *fetch_args: str) -> subprocess.CompletedProcess:
    """Run ``pdctl model fetch`` with the cache on a small tmpfs in a private mount namespace; after it, print
    the partial files left and ``pdctl model path``'s exit code (the tmpfs vanishes with the namespace)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare(1) to mount a small tmpfs in a private mount namespace")
    cache = tmp_path / "small"
    cache.mkdir()
    script = ('mount -t tmpfs -o size="$1" tmpfs "$2" || exit 99; shift 2; "$@"; rc=$?; '
              'echo "PARTIALS=$(find "$CACHE" -name "*.incomplete" | wc -l)"; '
              '"$PDCTL" model path pdtest/tiny --cache-dir "$CACHE" --config "$CFG" >/dev/null 2>&1; '
              'echo "PATH_RC=$?"; exit $rc')
    env = _env(tmp_path, endpoint)
    env.update(CACHE=str(cache), PDCTL=PDCTL[0] if len(PDCTL) == 1 else "false", CFG=str(tmp_path / "absent.toml"))
    r = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", size, str(cache), *PDCTL, "model", "fetch",
                        "pdtest/tiny", "--cache-dir", str(cache), "--config", str(tmp_path / "absent.toml"),
                        *fetch_args], capture_output=True, text=True, env=env, timeout=120)
    if r.returncode == 99:
        pytest.skip(f"cannot mount tmpfs here: {r.stderr.strip()}")
    return r


def test_disk_too_small_is_refused_before_downloading(hub, tmp_path):
    r = _in_tmpfs(tmp_path, hub.url, "8m")
    assert r.returncode == 2, r.stderr
    assert "not enough disk space in " + str(tmp_path / "small") in r.stderr, r.stderr
    total = sum(f.size for f in hub.repos["pdtest/tiny"].files.values())
    assert f"needs {total:,} bytes" in r.stderr and "bytes" in r.stderr.split("only")[1], r.stderr
    assert "[model] cache_dir" in r.stderr
    assert resolves(hub) == [], "nothing downloaded"
    assert "PARTIALS=0" in r.stdout and "PATH_RC=1" in r.stdout


def test_disk_full_during_download_is_a_clear_error_with_nothing_half_written(hub, tmp_path):
    hub.understate_sizes = True      # the listing says 1/16 of the real sizes: the pre-check passes, the disk fills
    r = _in_tmpfs(tmp_path, hub.url, "20m", "--no-progress")
    assert r.returncode == 2, r.stderr
    assert "disk full while writing the model into " + str(tmp_path / "small") in r.stderr, r.stderr
    assert "no space left on device" in r.stderr
    assert "PARTIALS=0" in r.stdout and "PATH_RC=1" in r.stdout, r.stdout


# ---- model strings, settings -----------------------------------------------------------------------------------
def test_model_strings(tmp_path):
    assert hub_id("llama-3.1-8b") == "meta-llama/Llama-3.1-8B-Instruct"
    assert hub_id("meta-llama/llama-3.1-8b-instruct") == "meta-llama/Llama-3.1-8B-Instruct"   # registry alias
    assert hub_id("org/some-model") == "org/some-model" and not is_local("org/some-model")
    assert is_local(str(tmp_path)) and is_local("./x") and not is_local("deepseek-v2-lite")
    with pytest.raises(ModelFetchError, match="local directory"):
        hub_id(str(tmp_path))
    with pytest.raises(ModelFetchError, match="unknown model"):
        hub_id("no-such-model")


def test_local_directory_is_used_as_is(tmp_path):
    (tmp_path / "m").mkdir()
    r = pdctl(tmp_path, "http://127.0.0.1:9", "fetch", str(tmp_path / "m"))
    assert r.returncode == 0 and r.stdout.strip() == str(tmp_path / "m") and "used as is" in r.stderr


def test_model_settings_keys_and_errors(tmp_path):
    s = config.resolve(tmp_path / "absent.toml", env={})
    assert s.get("model", "cache_dir") == "/var/cache/pdctl/hub" and s.get("model", "revision") == "main"
    assert s.get("model", "hf_token_file") == ""
    assert "[model]" in config.template() and "hf_token_file" in config.template()
    for body, key in (('revision = "a b"', "model.revision"), ('cache_dir = "relative/dir"', "model.cache_dir"),
                      ("hf_token_file = 3", "model.hf_token_file"), ('hf_token = "x"', "model.hf_token")):
        p = tmp_path / "bad.toml"
        p.write_text(f"schema_version = 1\n[model]\n{body}\n")
        with pytest.raises(config.ConfigError, match=f"{p}: {key}"):
            config.resolve(p, env={})
    r = pdctl(tmp_path, "http://127.0.0.1:9", "fetch", "pdtest/tiny", config_file=tmp_path / "bad.toml")
    assert r.returncode == 2 and "model.hf_token: unknown key" in r.stderr


# ---- the real engine starts from the snapshot, offline ---------------------------------------------------------
@pytest.mark.real_engine
@pytest.mark.slow
def test_real_vllm_cpu_engine_starts_offline_from_the_fetched_snapshot(tmp_path):
    from tests.real.stack import RealStack, build_model, complete, engines_venv_or_skip, free_ports
    venv = engines_venv_or_skip()
    model_dir, _ = build_model(venv, tmp_path / "tiny")
    cache = tmp_path / "cache"
    with HubServer() as hub:
        hub.add_repo("pdtest/tiny-llama", model_dir)
        r = pdctl(tmp_path, hub.url, "fetch", "pdtest/tiny-llama", "--cache-dir", str(cache))
        assert r.returncode == 0, r.stderr
    snap = Path(r.stdout.strip())
    assert tree_digest(snap) == tree_digest(model_dir)
    (dead,) = free_ports(1)
    (port,) = free_ports(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDCTL_", "HF_"))}
    env.update(PDCTL_INSTALL_ENGINE_VENV=str(venv), PDCTL_PORTS_PREFILL_BASE=str(port),
               PDCTL_PLAN_KV_CONNECTOR="false")   # one plain engine: no KV server needed for this check
    plan = subprocess.run([sys.executable, "-m", "appliance.cli", "plan", "--config", str(tmp_path / "absent.toml"),
                           "--engine", "vllm-cpu", "--model", str(snap), "--gpus", "none", "--json"],
                          capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=60)
    assert plan.returncode == 0, plan.stderr
    worker = json.loads(plan.stdout)["workers"][0]
    assert str(snap) in worker["argv"]
    wenv = {**worker["env"], **worker_env_for_snapshot(), "HF_ENDPOINT": f"http://127.0.0.1:{dead}"}
    stack = RealStack(plan={"workers": [worker]}, workdir=tmp_path)
    proc = stack.spawn(worker["instance"], worker["argv"], wenv, f"http://127.0.0.1:{worker['port']}")
    try:
        stack.wait_http([proc], "/health", float(os.environ.get("PDCTL_REAL_START_TIMEOUT_S", "240")))
        import httpx
        served = worker["argv"][worker["argv"].index("--served-model-name") + 1]
        with httpx.Client(timeout=60) as http:
            out = complete(http, proc.url, served, "the quick brown fox", max_tokens=8)
        assert out["usage"]["completion_tokens"] == 8 and out["choices"][0]["text"]
    finally:
        stack.stop()
    log = proc.log.read_text(errors="replace")
    assert f"127.0.0.1:{dead}" not in log, "the engine never tried the hub"


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
         "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
PLAN_SCRIPT = """
import json, sys
from appliance.settings.config import resolve
from appliance.plan.from_settings import plan_from_settings
from pathlib import Path
s = resolve(Path(sys.argv[1]), flags={"model": "pdtest/llama", "engine": "vllm-cpu", "gpus": "none", "cache_dir": sys.argv[2]})
p = plan_from_settings(s, probe_hub=sys.argv[3] == "probe")
print(json.dumps({"model": p.model, "served": p.served_model_name, "argv": list(p.workers[0].argv),
                  "env": p.workers[0].env}))
"""


def test_hub_id_outside_the_registry_is_planned_before_the_download_then_from_the_snapshot(tmp_path):
    """The installer plans a hub id it has not fetched from its config.json alone (nothing cached, no weights
    requested); once fetched, the plan loads the verified snapshot offline."""
    src = tmp_path / "llama"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(LLAMA))
    (src / "model.safetensors").write_bytes(os.urandom(3 * MiB))
    h = HubServer()
    h.add_repo("pdtest/llama", src)
    h.start()
    try:
        cache = tmp_path / "cache"
        env = _env(tmp_path, h.url)

        def plan(mode: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-c", PLAN_SCRIPT, str(tmp_path / "absent.toml"), str(cache), mode],
                                  capture_output=True, text=True, env=env, timeout=120)

        r = plan("plain")
        assert r.returncode != 0 and "pdctl model fetch pdtest/llama" in r.stderr, r.stderr[-1500:]
        r = plan("probe")
        assert r.returncode == 0, r.stderr[-2000:]
        got = json.loads(r.stdout)
        assert got["model"] == "pdtest/llama" and got["served"] == "llama", got
        assert not any(x.path.endswith("model.safetensors") and x.method == "GET" for x in h.requests)
        assert not cache.exists() or not any(cache.rglob("*.safetensors"))
        r = pdctl(tmp_path, h.url, "fetch", "pdtest/llama", "--cache-dir", str(cache))
        assert r.returncode == 0, r.stderr[-2000:]
        snap = r.stdout.strip().splitlines()[-1]
        got = json.loads(plan("plain").stdout)
        assert got["model"] == snap and snap in got["argv"] and got["env"].get("HF_HUB_OFFLINE") == "1", got
    finally:
        h.stop()
