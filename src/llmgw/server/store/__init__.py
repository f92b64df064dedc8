"""Durable state: the queries and SQLite (sql.py), PostgreSQL (postgres.py), which one a
config names (open.py), migrations, leadership (the lease on PostgreSQL)."""
