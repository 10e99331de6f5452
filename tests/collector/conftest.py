from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from collector_servers import Endpoint  # noqa: E402


@pytest.fixture
def endpoints():
    made: list[Endpoint] = []

    def make() -> Endpoint:
        e = Endpoint()
        made.append(e)
        return e
    yield make
    for e in made:
        e.close()
