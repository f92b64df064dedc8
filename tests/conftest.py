"""Fixtures every tier shares: a real PostgreSQL (fakes/postgres.py), skipped with how to
get it when it is not installed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fakes.postgres import HOW_TO_GET, PgServer, pg_bin


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    bin_dir = pg_bin()
    if bin_dir is None:
        pytest.skip(HOW_TO_GET)
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed: pip install -e '.[test]'")
    server = PgServer(bin_dir)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def pg_url(pg_server: PgServer) -> str:
    """A fresh, empty database in the session's PostgreSQL."""
    return pg_server.new_database()
