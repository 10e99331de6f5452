"""The model a bench run sends and how it counts prompt tokens: ``GET /v1/models`` of the target, and the tokenizer
(the model's own, or the twin rule fitted to the server's counts); shared by the single-turn bench (cli.py) and the
multi-turn one (session_cli.py)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from appliance.wire.fetch import fetch

from . import BenchError


async def served_model(url: str, timeout_s: float = 5.0, api_key: str | None = None) -> tuple[str, str]:
    """(served model id, model root) from ``/v1/models``; BenchError when the target cannot be reached."""
    from .loadgen import auth_headers
    r = await fetch(url.rstrip("/") + "/v1/models", headers=auth_headers(api_key), timeout_s=timeout_s)
    if r.error:
        raise BenchError(f"cannot reach {url} ({r.error}); start the stack (systemctl start pd.target) or pass "
                         "--url", code=1)
    if r.status == 401:
        raise BenchError(f"{url}/v1/models answered HTTP 401: the box has API keys on; pass --api-key-file FILE "
                         "(a file holding one key: `pdctl keys add bench`) or set OPENAI_API_KEY", code=1)
    if r.status != 200:
        raise BenchError(f"{url}/v1/models answered HTTP {r.status}; is the stack ready? (pdctl status), or pass "
                         "--model", code=1)
    try:
        d = r.json()
    except ValueError:
        raise BenchError(f"{url}/v1/models answered no JSON; pass --model NAME", code=1) from None
    try:
        m = d["data"][0]
        return str(m["id"]), str(m.get("root") or "")
    except (KeyError, IndexError, TypeError):
        raise BenchError(f"{url}/v1/models lists no model; pass --model NAME", code=1) from None


async def model_and_tokenizer(args: argparse.Namespace):
    """(model to send, how prompt lengths are counted): ``--model`` or the served one; ``--tokenizer``, the model's
    local directory, or the twin rule fitted to the server's own counts (unless ``--no-calibrate``)."""
    from .loadgen import prompt_token_counts
    from .workload import calibrated, calibration_texts, find_tokenizer
    key = args.api_key
    served, root = await served_model(args.url, api_key=key) if not args.model else (args.model, "")
    model = args.model or served
    tok = find_tokenizer(args.tokenizer or (model if Path(model).is_dir() else root or None))
    if not tok.exact and not args.no_calibrate:
        counts = await prompt_token_counts(args.url, model, calibration_texts(args.seed), args.request_timeout,
                                           api_key=key)
        tok = calibrated(counts)
        if None in counts and not args.quiet:
            print("pdctl bench: note: the server reported no usage.prompt_tokens for the calibration probes; "
                  "prompt lengths follow the twin rule (pass --tokenizer DIR for exact lengths)", file=sys.stderr)
    return model, tok
