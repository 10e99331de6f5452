"""Run the stand-in hub (tests/fixtures/hubserver.py) inside the test container until stopped.

usage: hub_runner.py REPO_ID SRC_DIR TOKEN_FILE URL_FILE  -- serves SRC_DIR as REPO_ID, gated by the token in
TOKEN_FILE, and writes its base URL (what HF_ENDPOINT is set to) to URL_FILE once it listens.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.fixtures.hubserver import HubServer  # noqa: E402

repo, src, token_file, url_file = sys.argv[1:5]
hub = HubServer()
hub.add_repo(repo, Path(src), token=Path(token_file).read_text().strip())
hub.start()
Path(url_file).write_text(hub.url)
while True:
    time.sleep(3600)
