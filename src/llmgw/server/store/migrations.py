"""The state schema as versioned migrations, one script per engine (SQLite, PostgreSQL).

Migration N takes a database at version N-1 to version N; both engines reach the same
tables with the same columns, only the types and the id column differ. A store runs what
is missing when it opens, in one transaction per version; a database newer than this
llmgw is refused, never downgraded.
"""

from __future__ import annotations

SQLITE = "sqlite"
POSTGRES = "postgres"

# Version 1 for SQLite is exactly the schema llmgw shipped before PostgreSQL: databases
# already at version 1 were made by it.
_V1_SQLITE = (
    "CREATE TABLE deployments (name TEXT PRIMARY KEY, spec TEXT NOT NULL,"
    " updated REAL NOT NULL DEFAULT 0)",
    "CREATE TABLE replicas (id TEXT PRIMARY KEY, deployment TEXT NOT NULL,"
    " generation INTEGER NOT NULL, data TEXT NOT NULL)",
    "CREATE INDEX replicas_by_deployment ON replicas (deployment)",
    "CREATE TABLE nodes (id TEXT PRIMARY KEY, info TEXT NOT NULL, inventory TEXT NOT NULL,"
    " cordoned INTEGER NOT NULL DEFAULT 0, draining INTEGER NOT NULL DEFAULT 0,"
    " last_seen REAL NOT NULL DEFAULT 0)",
    "CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL,"
    " deployment TEXT NOT NULL DEFAULT '', replica TEXT NOT NULL DEFAULT '',"
    " text TEXT NOT NULL)",
    "CREATE INDEX events_by_deployment ON events (deployment, id)",
    "CREATE INDEX events_by_replica ON events (replica, id)",
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
)

_V1_POSTGRES = (
    "CREATE TABLE deployments (name TEXT PRIMARY KEY, spec TEXT NOT NULL,"
    " updated DOUBLE PRECISION NOT NULL DEFAULT 0)",
    "CREATE TABLE replicas (id TEXT PRIMARY KEY, deployment TEXT NOT NULL,"
    " generation BIGINT NOT NULL, data TEXT NOT NULL)",
    "CREATE INDEX replicas_by_deployment ON replicas (deployment)",
    "CREATE TABLE nodes (id TEXT PRIMARY KEY, info TEXT NOT NULL, inventory TEXT NOT NULL,"
    " cordoned INTEGER NOT NULL DEFAULT 0, draining INTEGER NOT NULL DEFAULT 0,"
    " last_seen DOUBLE PRECISION NOT NULL DEFAULT 0)",
    "CREATE TABLE events (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
    " ts DOUBLE PRECISION NOT NULL, deployment TEXT NOT NULL DEFAULT '',"
    " replica TEXT NOT NULL DEFAULT '', text TEXT NOT NULL)",
    "CREATE INDEX events_by_deployment ON events (deployment, id)",
    "CREATE INDEX events_by_replica ON events (replica, id)",
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
)

# Version 2: the leader lease (leader.py). One row; the epoch only ever grows. SQLite
# keeps the table too (same schema everywhere) but a SQLite server never reads it: it is
# single-server by construction.
_V2 = (
    "CREATE TABLE leader (id INTEGER PRIMARY KEY CHECK (id = 1), epoch BIGINT NOT NULL,"
    " holder TEXT NOT NULL, address TEXT NOT NULL, expires DOUBLE PRECISION NOT NULL)",
    "INSERT INTO leader (id, epoch, holder, address, expires) VALUES (1, 0, '', '', 0)",
)

# Version 3: tenants (API keys and limits). API keys by name (only the secret's hash is kept); usage
# per key x model x hour x status, added to in place; the ids of the usage batches already
# added, so that a batch a router sends again (after a failover) counts once.
def _v3(real: str, big: str) -> tuple[str, ...]:
    return (
        f"CREATE TABLE api_keys (name TEXT PRIMARY KEY, sha256 TEXT NOT NULL UNIQUE,"
        f" data TEXT NOT NULL, updated {real} NOT NULL DEFAULT 0)",
        f"CREATE TABLE usage (api_key TEXT NOT NULL, model TEXT NOT NULL, hour {big} NOT NULL,"
        f" status INTEGER NOT NULL, requests {big} NOT NULL DEFAULT 0,"
        f" prompt_tokens {big} NOT NULL DEFAULT 0, completion_tokens {big} NOT NULL DEFAULT 0,"
        f" latency_sum {real} NOT NULL DEFAULT 0, PRIMARY KEY (api_key, model, hour, status))",
        "CREATE INDEX usage_by_hour ON usage (hour)",
        f"CREATE TABLE usage_batches (id TEXT PRIMARY KEY, at {real} NOT NULL)",
    )


MIGRATIONS: dict[int, dict[str, tuple[str, ...]]] = {
    1: {SQLITE: _V1_SQLITE, POSTGRES: _V1_POSTGRES},
    2: {SQLITE: _V2, POSTGRES: _V2},
    3: {SQLITE: _v3("REAL", "INTEGER"), POSTGRES: _v3("DOUBLE PRECISION", "BIGINT")},
}
SCHEMA_VERSION = max(MIGRATIONS)


def steps(dialect: str, current: int) -> list[tuple[int, tuple[str, ...]]]:
    """The (version, statements) still to run on a database at `current`, in order.
    Raises ValueError for a database newer than this llmgw."""
    if current > SCHEMA_VERSION:
        raise ValueError(
            f"schema version {current} is newer than this llmgw understands "
            f"({SCHEMA_VERSION}); upgrade llmgw"
        )
    return [(v, MIGRATIONS[v][dialect]) for v in range(current + 1, SCHEMA_VERSION + 1)]
