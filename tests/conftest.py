"""Fixtures every tier shares: a real PostgreSQL (fakes/postgres.py), skipped with how to
get it when it is not installed (a failure instead under LLMGW_REQUIRE_POSTGRES=1)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

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
