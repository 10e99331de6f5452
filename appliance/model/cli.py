"""``pdctl model fetch|path``: the model downloaded once before the workers start, and where it lies.

``fetch`` prints ``[INFO]`` lines and the download's progress bars on stderr and the snapshot path, alone,
on stdout (``MODEL=$(pdctl model fetch)``); ``path`` prints the verified snapshot or exits 1. A local
directory is used as is by both. Exit 2 on a fetch that cannot succeed, with the cause and the fix.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import constants as C
from ..errors import EXIT_BAD, EXIT_FAIL, EXIT_OK


def _settings(args: argparse.Namespace):
    from ..settings.config import resolve
    return resolve(args.config, flags={"model": args.model, "revision": getattr(args, "revision", None),
                                       "cache_dir": getattr(args, "cache_dir", None),
                                       "token_file": getattr(args, "token_file", None)})


def cmd_fetch(args: argparse.Namespace) -> int:
    from .fetch import ModelFetchError, fetch, hub_id, is_local, read_token
    s = _settings(args)
    model = s.get("install", "model")
    try:
        if is_local(model):
            print(f"[INFO] {model} is a local directory: used as is, nothing to fetch", file=sys.stderr)
            print(Path(model).expanduser().resolve())
            return EXIT_OK
        token = read_token(s.get("model", "hf_token_file"))
        res = fetch(hub_id(model), revision=s.get("model", "revision"), cache_dir=Path(s.get("model", "cache_dir")),
                    token=token, progress=not args.no_progress, out=sys.stderr)
    except ModelFetchError as exc:
        print(f"pdctl model fetch: error: {exc}", file=sys.stderr)
        return EXIT_BAD
    print(res.path)
    return EXIT_OK


def cmd_path(args: argparse.Namespace) -> int:
    from .fetch import ModelFetchError, hub_id, is_local, local_snapshot
    s = _settings(args)
    model = s.get("install", "model")
    if is_local(model):
        print(Path(model).expanduser().resolve())
        return EXIT_OK
    try:
        repo = hub_id(model)
    except ModelFetchError as exc:
        print(f"pdctl model path: error: {exc}", file=sys.stderr)
        return EXIT_BAD
    snap = local_snapshot(repo, s.get("model", "revision"), s.get("model", "cache_dir"))
    if snap is None:
        print(f"pdctl model path: {repo}@{s.get('model', 'revision')} is not fetched (no verified snapshot in "
              f"{s.get('model', 'cache_dir')}); run `pdctl model fetch {model}`", file=sys.stderr)
        return EXIT_FAIL
    print(snap)
    return EXIT_OK


def register(sub) -> None:
    p = sub.add_parser("model", help="fetch the model from the hub once (verified, for offline workers); its path")
    verbs = p.add_subparsers(dest="model_verb", required=True, metavar="ACTION")
    for name, func, helptext in (
            ("fetch", cmd_fetch, "download MODEL into the cache, verify it, print the snapshot path"),
            ("path", cmd_path, "print the verified snapshot of MODEL (exit 1 when not fetched)")):
        q = verbs.add_parser(name, help=helptext)
        q.add_argument("model", nargs="?", metavar="MODEL",
                       help="registry name, hub id (org/name) or local directory (default: [install] model)")
        q.add_argument("--revision", help="branch, tag or commit (default: [model] revision)")
        q.add_argument("--cache-dir", dest="cache_dir", help=f"cache (default: [model] cache_dir, {C.MODEL_CACHE_DIR})")
        q.add_argument("--config", type=Path, default=C.CONFIG_PATH, help="settings file (default %(default)s)")
        if name == "fetch":
            q.add_argument("--token-file", dest="token_file",
                           help="file with the hub token, mode 0600 (default: [model] hf_token_file)")
            q.add_argument("--no-progress", action="store_true", help="no progress bars")
        q.set_defaults(func=func)
