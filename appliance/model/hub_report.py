"""What an operator sees of a hub download: its progress bars and its errors (cause and fix, never the token).

Apart from fetch.py so the download's steps read without the library's error zoo: every exception the hub
library can raise becomes one ModelFetchError sentence here.
"""
from __future__ import annotations

import contextlib
import errno
import logging
from pathlib import Path

TOKEN_KEY = "[model] hf_token_file"


class ModelFetchError(RuntimeError):
    """A fetch that cannot succeed: the message says the cause and the fix (CLI exit code 2)."""


# --- progress bars ----------------------------------------------------------------------------------
def bar_class(out):
    """A plain tqdm class writing to ``out`` (huggingface_hub's own class hides the bars when not on a TTY)."""
    import threading

    from tqdm import tqdm

    interval = 0.1 if getattr(out, "isatty", lambda: False)() else 1.0

    class Bar(tqdm):
        _lock = threading.RLock()   # tqdm's default lock would start a multiprocessing resource tracker

        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            kwargs.setdefault("file", out)
            kwargs.setdefault("mininterval", interval)
            super().__init__(*args, **kwargs)
    return Bar


class Null:
    """Where the bars go with ``progress=False``."""

    def write(self, s: str) -> int:
        return len(s)

    def flush(self) -> None:
        pass


# --- errors -----------------------------------------------------------------------------------------
class _ScrubFilter(logging.Filter):
    def __init__(self, token: str) -> None:
        super().__init__()
        self.token = token

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if self.token in msg:
            record.msg, record.args = msg.replace(self.token, "***"), None
        return True


@contextlib.contextmanager
def scrubbed(token: str | None, repo_id: str, revision: str, cache: Path, endpoint: str | None):
    """Turn library errors into ModelFetchError with cause and fix; the token is cut out of every message."""
    hf_log = logging.getLogger("huggingface_hub")
    filt = _ScrubFilter(token) if token else None
    if filt:
        hf_log.addFilter(filt)
    try:
        yield
    except ModelFetchError as exc:
        raise ModelFetchError(_scrub(str(exc), token)) from None
    except Exception as exc:  # noqa: BLE001 (every library error becomes one clear message)
        raise ModelFetchError(_scrub(_explain(exc, repo_id, revision, cache, endpoint), token)) from None
    finally:
        if filt:
            hf_log.removeFilter(filt)


def _scrub(text: str, token: str | None) -> str:
    return text.replace(token, "***") if token else text


def _explain(exc: Exception, repo_id: str, revision: str, cache: Path, endpoint: str | None) -> str:
    from huggingface_hub import constants as hf_constants
    from huggingface_hub import errors as hf
    url = endpoint or hf_constants.ENDPOINT
    names = {c.__name__ for c in type(exc).__mro__}
    status = getattr(getattr(exc, "response", None), "status_code", None)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, hf.GatedRepoError):    # before RepositoryNotFoundError: it is a subclass
        return (f"{repo_id} is gated and the hub refused access (HTTP {status}): the token is missing or has no "
                f"access to it; put a token that has been granted access in the file named by {TOKEN_KEY} "
                "(mode 0600)")
    if isinstance(exc, hf.RepositoryNotFoundError):
        return (f"{repo_id} not found on {url} (HTTP {status}): check the name, or if it is private, set "
                f"{TOKEN_KEY} to a file holding a token with access to it")
    if isinstance(exc, hf.RevisionNotFoundError):
        return f"{repo_id} has no revision {revision!r} on {url}: check [model] revision (a branch, tag or commit)"
    if isinstance(exc, hf.OfflineModeIsEnabled) or "OfflineModeIsEnabled" in names:
        return "HF_HUB_OFFLINE is set in this environment: unset it to fetch (only the workers run offline)"
    if status in (401, 403):
        return (f"the hub rejected the token for {repo_id} (HTTP {status}: {first}); check the token in the file "
                f"named by {TOKEN_KEY}")
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return (f"disk full while writing the model into {cache} (no space left on device); nothing was marked "
                "as fetched; free space there or set [model] cache_dir to a larger disk, then fetch again")
    if names & {"ConnectError", "ConnectTimeout", "TimeoutException", "ConnectionError", "RemoteProtocolError",
                "LocalEntryNotFoundError", "ProxyError"}:
        return (f"cannot reach the hub at {url} ({type(exc).__name__}: {first}); check the network, or HF_ENDPOINT "
                "if it points at a mirror")
    if isinstance(exc, hf.HfHubHTTPError):
        return f"the hub at {url} answered HTTP {status} for {repo_id}: {first}"
    if isinstance(exc, OSError):
        return f"fetching {repo_id} into {cache} failed: {exc}"
    return f"fetching {repo_id} failed: {type(exc).__name__}: {first}"
