"""Model fetch: a hub model downloaded once, verified, into pdctl's cache; the workers start from it offline.

Why a step of its own: vLLM would otherwise download the model inside every worker at start-up (N workers
racing for the same files, a start-up timeout that depends on the network, a token in every worker's
environment). Here the download happens once, before the workers start, through ``huggingface_hub`` (the
hub's own cache layout, its progress bars and its HTTP resume), and a snapshot is used only after every
file's size, and its checksum where the hub gives one, has been checked and a marker written. The token
comes from a 0600 file named in the settings, is sent only to the hub and appears in no message.
A local model directory is never copied: it is used as is.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from .. import constants as C
from ..settings.schema import default as _d
from .hub_report import TOKEN_KEY, ModelFetchError, Null, bar_class, scrubbed

MARKER_DIR = ".pdctl-verified"     # <cache>/models--org--name/.pdctl-verified/<revision>.json
SPACE_MARGIN = 16 * 1024**2        # headroom on top of the missing bytes (locks, refs, metadata; or 1 %)


@dataclass(frozen=True)
class FetchResult:
    path: Path          # the verified snapshot directory: give it to the engines as the model
    files: int
    bytes: int
    seconds: float
    downloaded: bool = True   # False: the snapshot was already complete and verified


@dataclass(frozen=True)
class _File:
    path: str
    size: int
    sha256: str | None    # LFS files: the content's sha256 as the hub lists it
    blob_id: str | None   # git blob id (sha1 of "blob <size>\0" + content) for non-LFS files

    @property
    def etag(self) -> str | None:
        """The name huggingface_hub gives the file's blob (the hub's ETag: sha256 for LFS, git oid otherwise)."""
        return self.sha256 or self.blob_id


# --- model strings ---------------------------------------------------------------------------------
def is_local(model: str) -> bool:
    """True for a local model directory (used as is); registry names and ``org/name`` hub ids are not local."""
    from .profiles import ALIASES, REGISTRY
    key = model.strip().lower()
    if key in REGISTRY or key in ALIASES:
        return False
    return model.startswith(("/", ".", "~")) or Path(model).is_dir()


def hub_id(model: str) -> str:
    """The hub repo id to fetch: a registry name maps to its ``hf_id``; ``org/name`` that is no path is itself."""
    from .profiles import ALIASES, REGISTRY
    key = model.strip().lower()
    if key in REGISTRY or key in ALIASES:
        return REGISTRY[ALIASES.get(key, key)].hf_id
    if is_local(model):
        raise ModelFetchError(f"{model} is a local directory: it is used as is, there is nothing to fetch")
    if model.count("/") == 1 and all(model.split("/")):
        return model
    raise ModelFetchError(f"unknown model {model!r}: give a registry name ({', '.join(sorted(REGISTRY))}), a hub "
                          "id (org/name) or a local model directory")


# --- token ------------------------------------------------------------------------------------------
def read_token(path: str | Path | None) -> str | None:
    """The token in ``path`` (None when no file is configured); refuses a file others could read.

    The file must be a regular file owned by root (or the caller), mode 0600 or stricter, and not empty.
    """
    if not path:
        return None
    p = Path(path)
    try:
        st = p.stat()
    except OSError as exc:
        raise ModelFetchError(f"{TOKEN_KEY} {p}: cannot read ({exc.strerror}); create it with the token on one "
                              f"line (`install -m 600 /dev/null {p}`, then write the token) or set the key to ''") \
            from None
    if not stat.S_ISREG(st.st_mode):
        raise ModelFetchError(f"{TOKEN_KEY} {p}: not a regular file")
    if st.st_mode & 0o077:
        raise ModelFetchError(f"{TOKEN_KEY} {p}: mode {stat.S_IMODE(st.st_mode):04o} lets group or others read the "
                              f"token; run `chmod 600 {p}`")
    if st.st_uid not in (0, os.geteuid()):
        raise ModelFetchError(f"{TOKEN_KEY} {p}: owned by uid {st.st_uid}, not root; run `chown root: {p}`")
    try:
        token = p.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelFetchError(f"{TOKEN_KEY} {p}: cannot read ({exc})") from None
    if not token:
        raise ModelFetchError(f"{TOKEN_KEY} {p}: empty; write the token into it or set the key to ''")
    return token


# --- cache layout -----------------------------------------------------------------------------------
def _storage(repo_id: str, cache_dir: Path) -> Path:
    """``<cache>/models--org--name``: huggingface_hub's folder for one model repo."""
    return Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))


def _marker(storage: Path, revision: str) -> Path:
    return storage / MARKER_DIR / (quote(revision, safe="") + ".json")


def local_snapshot(repo_id: str, revision: str = _d("model", "revision"),
                   cache_dir: str | Path = C.MODEL_CACHE_DIR) -> Path | None:
    """The verified snapshot of ``repo_id@revision`` in the cache, or None; no network.

    Only a snapshot whose marker exists and whose files are all present at their verified sizes counts:
    a download that stopped half way is never returned.
    """
    try:
        mark = json.loads(_marker(_storage(repo_id, Path(cache_dir)), revision).read_text())
        snap = _storage(repo_id, Path(cache_dir)) / "snapshots" / mark["commit"]
        if not snap.is_dir():
            return None
        for rel, size in mark["files"].items():
            if (snap / rel).stat().st_size != size:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return snap


def worker_env_for_snapshot() -> dict:
    """Environment for engines started from a fetched snapshot: no hub access at all (no token, no network)."""
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


# --- probe: what the planner needs before the download ----------------------------------------------
def fetch_config(repo_id: str, dest: str | Path, *, revision: str = _d("model", "revision"), token: str | None = None,
                 endpoint: str | None = None) -> int:
    """``config.json`` of ``repo_id`` into the directory ``dest`` (kilobytes), and the repo's total bytes.

    Why: a hub id outside the registry has no profile until its config.json is read, and the preflight
    and the plan come before the (large) download. The real fetch then goes to the cache as usual.
    """
    cache = Path(dest)
    with scrubbed(token, repo_id, revision, cache, endpoint):
        from huggingface_hub import HfApi, hf_hub_download
        from huggingface_hub import constants as hf_constants
        hf_constants.HF_HUB_DISABLE_TELEMETRY = True
        info = HfApi(endpoint=endpoint, token=token or False).model_info(repo_id, revision=revision,
                                                                          files_metadata=True)
        names = {s.rfilename for s in info.siblings or []}
        if "config.json" not in names:
            raise ModelFetchError(f"{repo_id}@{revision} has no config.json: not a Hugging Face model repo "
                                  "vLLM can serve")
        hf_hub_download(repo_id, "config.json", revision=info.sha, local_dir=cache, token=token or False,
                        endpoint=endpoint)
        return sum(int(s.size or (s.lfs.size if s.lfs else 0)) for s in info.siblings or [])


# --- fetch ------------------------------------------------------------------------------------------
def fetch(repo_id: str, *, revision: str = _d("model", "revision"), cache_dir: str | Path = C.MODEL_CACHE_DIR,
          token: str | None = None, progress: bool = True, out=sys.stderr, endpoint: str | None = None) -> FetchResult:
    """Download ``repo_id@revision`` into ``cache_dir`` (huggingface_hub layout), verify it, mark it complete.

    Steps: the file list with sizes and LFS sha256 (``model_info(files_metadata=True)``); a free-space check
    against the bytes still missing; ``snapshot_download`` of that exact commit (files already in the cache
    are kept, an interrupted transfer is resumed by the library with a Range request); sizes and checksums
    checked, a bad file deleted; the cache made readable for the service user; the marker written last.
    ``out`` gets ``[INFO]`` lines and, with ``progress``, the library's progress bars. Every failure is a
    ModelFetchError naming the cause; the token never appears in it.
    """
    t0 = time.monotonic()
    cache = Path(cache_dir)
    say = (lambda msg: print(msg, file=out, flush=True)) if out is not None else (lambda msg: None)
    with scrubbed(token, repo_id, revision, cache, endpoint):
        from huggingface_hub import HfApi, snapshot_download
        from huggingface_hub import constants as hf_constants
        hf_constants.HF_HUB_DISABLE_TELEMETRY = True   # no user-agent probing, no side request to the hub
        url = endpoint or hf_constants.ENDPOINT
        say(f"[INFO] fetching {repo_id}@{revision} from {url} into {cache}")
        # token=False: never fall back to HF_TOKEN or ~/.cache/huggingface/token; only the configured file counts
        info = HfApi(endpoint=endpoint, token=token or False).model_info(repo_id, revision=revision,
                                                                          files_metadata=True)
        commit = info.sha
        files = [_File(s.rfilename, int(s.size or (s.lfs.size if s.lfs else 0)),
                       s.lfs.sha256 if s.lfs else None, None if s.lfs else s.blob_id) for s in info.siblings or []]
        total = sum(f.size for f in files)
        _mkdirs(cache)
        storage = _storage(repo_id, cache)
        storage.mkdir(mode=0o755, exist_ok=True)
        with _repo_lock(storage):
            snap = local_snapshot(repo_id, revision, cache)
            if snap is not None and snap.name == commit:
                say(f"[INFO] {repo_id}@{revision} ({commit[:12]}) already fetched and verified: {snap}")
                return FetchResult(snap, len(files), total, time.monotonic() - t0, downloaded=False)
            _remove_stale_partials(storage)
            missing = sum(f.size for f in files if not _present(storage, commit, f))
            _check_space(cache, missing)
            say(f"[INFO] {repo_id}@{revision} = commit {commit}: {len(files)} files, {_mb(total)}, "
                f"{_mb(missing)} to download")
            bars = bar_class(out if progress and out is not None else Null())
            path = Path(snapshot_download(repo_id, revision=commit, cache_dir=cache, token=token or False,
                                          endpoint=endpoint, tqdm_class=bars))
            _verify(path, files)
            _write_ref(storage, revision, commit)
            _make_readable(cache, storage)
            _write_marker(storage, revision, commit, files)
    secs = time.monotonic() - t0
    say(f"[INFO] verified {len(files)} files ({_mb(total)}) in {secs:.1f} s: {path}")
    return FetchResult(path, len(files), total, secs)


def _mb(n: int) -> str:
    return f"{n / 1024**2:,.1f} MiB"


def _present(storage: Path, commit: str, f: _File) -> bool:
    return (storage / "snapshots" / commit / f.path).exists() or bool(f.etag and (storage / "blobs" / f.etag).exists())


def _mkdirs(cache: Path) -> None:
    """Create the cache (and parents) traversable by the service user, whatever the umask."""
    missing = [p for p in [cache, *cache.parents] if not p.exists()]
    cache.mkdir(parents=True, exist_ok=True)
    for p in missing:
        os.chmod(p, 0o755)


@contextlib.contextmanager
def _repo_lock(storage: Path):
    """One fetch per repo at a time (two installers, or an installer and an operator)."""
    with open(storage / ".pdctl-fetch.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _remove_stale_partials(storage: Path) -> None:
    """Partial files a killed fetch left behind (this library version cannot resume them across runs)."""
    for p in (storage / "blobs").glob("*.incomplete"):
        p.unlink(missing_ok=True)


def _check_space(cache: Path, missing: int) -> None:
    free = shutil.disk_usage(cache).free
    margin = max(SPACE_MARGIN, missing // 100)
    if missing and free < missing + margin:
        raise ModelFetchError(f"not enough disk space in {cache}: the download needs {missing:,} bytes "
                              f"({_mb(missing)}) plus {_mb(margin)} headroom, only {free:,} bytes "
                              f"({_mb(free)}) are free; free space there or set [model] cache_dir to a larger disk")


def _digest(path: Path, algo: str, size: int) -> str:
    h = hashlib.new(algo)
    if algo == "sha1":
        h.update(b"blob %d\0" % size)    # git's blob id
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _verify(snap: Path, files: list[_File]) -> None:
    """Every file at the listed size; LFS files at their sha256, others at their git blob id."""
    for f in files:
        p = snap / f.path
        try:
            size = p.stat().st_size
        except OSError:
            raise ModelFetchError(f"{f.path} is missing from the downloaded snapshot {snap}; run the fetch "
                                  "again") from None
        problem = f"size {size:,} bytes, the hub lists {f.size:,}" if size != f.size else ""
        if not problem and f.sha256 and (got := _digest(p, "sha256", size)) != f.sha256:
            problem = f"sha256 {got}, the hub lists {f.sha256}"
        if not problem and f.blob_id and len(f.blob_id) == 40 and (got := _digest(p, "sha1", size)) != f.blob_id:
            problem = f"git blob id {got}, the hub lists {f.blob_id}"
        if problem:
            blob = p.resolve()
            p.unlink(missing_ok=True)
            blob.unlink(missing_ok=True)
            raise ModelFetchError(f"{f.path}: downloaded file has {problem}; the bad copy was deleted, run the "
                                  "fetch again (if it repeats, the hub or a proxy in between serves bad data)")


def _write_ref(storage: Path, revision: str, commit: str) -> None:
    """``refs/<revision>`` as huggingface_hub writes it, so offline library look-ups find the snapshot too."""
    if revision != commit:
        _atomic(storage / "refs" / revision, commit)


def _write_marker(storage: Path, revision: str, commit: str, files: list[_File]) -> None:
    doc = {"revision": revision, "commit": commit, "files": {f.path: f.size for f in files},
           "bytes": sum(f.size for f in files), "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _atomic(_marker(storage, revision), json.dumps(doc, indent=1))


def _atomic(path: Path, text: str) -> None:
    from ..settings.config import atomic_write
    atomic_write(path, text, mode=0o644)
    os.chmod(path.parent, 0o755)


def _make_readable(cache: Path, storage: Path) -> None:
    """Directories a+rx, files a+r: the workers run as the unprivileged service user, the fetch as root."""
    for d in (cache, storage):
        os.chmod(d, os.stat(d).st_mode | 0o755)
    for root, dirs, names in os.walk(storage):
        for d in dirs:
            p = os.path.join(root, d)
            os.chmod(p, os.stat(p).st_mode | 0o755)
        for n in names:
            p = os.path.join(root, n)
            if not os.path.islink(p):
                os.chmod(p, os.stat(p).st_mode | 0o444)
