"""Which store a server's configuration names: PostgreSQL when `[store] url` is set, else
SQLite in `state_dir`. Apart from store.py so that store.py (the queries, SQLite) and
store_pg.py (PostgreSQL, built on store.py) import each other in one direction only."""

from __future__ import annotations

import os

from llmgw.config.server import ServerConfig
from llmgw.server.store.sql import SqlStore, Store, StoreError


def open_store(config: ServerConfig) -> SqlStore:
    """The store the configuration names: PostgreSQL when `[store] url` is set, else
    SQLite in `state_dir`. Opening migrates."""
    if config.store.url:
        try:
            from llmgw.server.store.postgres import PgStore
        except ImportError:
            raise StoreError("store.url names PostgreSQL, but psycopg is not installed: "
                             "pip install 'llmgw[postgres]'") from None
        return PgStore.from_config(config.store)
    os.makedirs(config.state_dir, exist_ok=True)
    return Store(os.path.join(config.state_dir, "state.db"))
