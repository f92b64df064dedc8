from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fakes.live import Cluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Keys and a server config in tmp_path; every process it starts is stopped after."""
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()
