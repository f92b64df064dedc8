"""The server's configuration (conf/server.toml). Shapes only here; loading in load_server.py."""

from __future__ import annotations

from attrs import field, frozen

from llmgw.config.duration import Duration


@frozen
class StoreConfig:
    """Where the state lives. No url: SQLite in state_dir (one server). A postgresql://
    url: PostgreSQL, shared by any number of servers, one of them the leader."""

    url: str = ""  # postgresql://user@host:5432/db; a password here only in a 0600 file
    password_file: str = ""  # holds the database password (not readable by others)
    password_env: str = ""  # or: the environment variable that holds it
    lease: Duration = 10.0  # a leader silent this long loses the lead to a standby
    connect_timeout: Duration = 5.0


@frozen
class ServerConfig:
    bind: str = "tcp://0.0.0.0:7443"
    keys_dir: str = "/etc/llmgw/keys"
    state_dir: str = "/var/lib/llmgw-server"
    heartbeat_interval: Duration = 5.0  # what agents are told to expect
    suspect_after_missed: int = 3  # missed heartbeats before a node is suspect
    lost_after: Duration = 60.0  # grace period of silence before a node is lost
    # After the server starts, nodes get this long to reconnect before any is lost.
    restart_grace: Duration = 120.0
    # More than this share of nodes silent within one grace period: hold re-placement.
    mass_loss_share: float = 0.3
    # A draining replica (scaled down, deleted, replaced) whose engine is idle stops no
    # sooner than this after its drain began: every router has polled the endpoint table
    # since (table_poll_interval, 1 s by default) and the agent has read the engine's
    # in-flight count since (health_interval, 2 s). Raise it with either.
    drain_grace: Duration = 6.0
    max_message_size: int = 4 * 1024 * 1024
    # host:port of the HTTP listener with /metrics (Prometheus), the status page at / and
    # /status.json. Empty: no listener. Anything but loopback needs metrics_token.
    metrics_bind: str = "127.0.0.1:9464"
    # Empty: no token (loopback only). Else requests carry `Authorization: Bearer TOKEN`
    # (or `?token=TOKEN` for the page in a browser).
    metrics_token: str = ""
    # The address agents, routers and ctl reach this server at, as they write it in their
    # lists: standbys name the leader by it. "" = bind, when bind names a host.
    advertise: str = ""
    store: StoreConfig = field(factory=StoreConfig)
    source: str = ""
