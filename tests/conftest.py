"""Fixtures every tier shares: a real PostgreSQL (fakes/postgres.py), skipped with how to
get it when it is not installed (a failure instead under LLMGW_REQUIRE_POSTGRES=1); a
live Cluster (fakes/live.py) and a headless browser (fakes/browser.py), stopped when the
test ends."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fakes.browser import Browser
from fakes.live import Cluster
from fakes.postgres import HOW_TO_GET, PgServer, pg_bin

REQUIRE_ENV = "LLMGW_REQUIRE_POSTGRES"  # .ci/run sets it: there a missing PostgreSQL fails


def _without(why: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    bin_dir = pg_bin()
    if bin_dir is None:
        _without(HOW_TO_GET)
    try:
        import psycopg  # noqa: F401
    except ImportError:
        _without("psycopg is not installed: pip install -e '.[test]'")
    assert bin_dir is not None
    server = PgServer(bin_dir)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def pg_url(pg_server: PgServer) -> str:
    """A fresh, empty database in the session's PostgreSQL."""
    return pg_server.new_database()


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """A Cluster in tmp_path made with Cluster's keyword arguments, for rigs that need
    other server settings; every process it starts is stopped after."""
    made: list[Cluster] = []

    def make(**kw: Any) -> Cluster:
        assert not made, "one Cluster per test: a second would share its tmp_path"
        made.append(Cluster(tmp_path, **kw))
        return made[0]
    try:
        yield make
    finally:
        for c in made:
            c.close()


@pytest.fixture
def cluster(make_cluster: Callable[..., Cluster]) -> Cluster:
    """Keys and a server config in tmp_path; every process it starts is stopped after."""
    return make_cluster()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    """Headless Chromium; a test that takes it skips itself where it is not installed
    (fakes.browser.available)."""
    b = Browser(tmp_path / "chromedriver.log")
    try:
        yield b
    finally:
        b.close()
