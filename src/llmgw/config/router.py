"""The router's configuration (conf/router.toml). Shapes only here; loading in load_router.py.

Durations are float seconds once loaded; files say `250ms`, `1s`, `5m`.
"""

from __future__ import annotations

from attrs import field, frozen

from llmgw.config.addresses import Addresses, to_addresses
from llmgw.config.duration import Duration

POLICIES = ("least_outstanding", "prefix_affinity", "kv_aware")
# kv_aware's bounds: an index of more blocks than this per replica is a typo (about 300
# bytes a block), a speculation longer than this outlives any burst.
MAX_KV_INDEX_BLOCKS = 10_000_000
MAX_KV_SPECULATIVE_TTL = 60.0


@frozen
class RouterKeysConfig:
    secret_key: str  # the router's secret key file (`llmgw keys issue router NAME` wrote it)
    server_key: str  # the server's public key file


@frozen
class ModelRouteConfig:
    # Mid-stream failover: how many times a stream whose engine fails after the first
    # byte may go on on another replica (docs/router.md); 0: never, the stream then ends
    # with an error event.
    failover_migrations: int = 1
    # How requests for this model pick a replica: "least_outstanding", "prefix_affinity" or
    # "kv_aware" (by the KV-cache blocks the engines hold).
    policy: str = "least_outstanding"
    # With prefix_affinity: how many leading characters of the prompt choose the replica
    # (kv_aware's fallback too).
    prefix_chars: int = 256
    # kv_aware: routed by the blocks the engines say they hold (their KV-cache events,
    # relayed by the agents). `tokenizer` is the folder of the model's tokenizer.json,
    # tokenizer_config.json (and chat_template.jinja), read once at start; a tokenizer
    # that cannot be had makes the model prefix_affinity, with a log line and a metric.
    tokenizer: str = ""
    # Queued requests one uncached block of the prompt is worth (score = kv_weight x
    # uncached blocks + load). 0.1: with vLLM's 16-token GPU blocks, a request sharing a
    # 2k-token prefix prefers the replica that holds it until that one has ~13 requests
    # more than another: the prefill saved decides between replicas of like load, and a
    # burst of one prefix still spreads before a replica queues deeply.
    kv_weight: float = 0.1
    # A request's blocks count as held by the replica it went to for this long, before
    # the engine's own events say so: the rest of a burst follows it. 0: no speculation.
    kv_speculative_ttl: Duration = 2.0
    # Engine blocks the router remembers per replica (about 300 bytes each): enough for
    # the whole KV cache of an 80 GB GPU at 16-token blocks for most models.
    kv_index_blocks: int = 100_000


@frozen
class ClassConfig:
    """A priority class (a band of the fair queue): `name` as API keys and the
    `x-llmgw-class` header say it, `ttl` how long its requests may wait for a slot."""

    name: str
    ttl: Duration


@frozen
class RouterConfig:
    # tcp://host:port, or a list of them (several servers: the one that leads answers).
    server: Addresses = field(converter=to_addresses)
    keys: RouterKeysConfig
    bind: str = "127.0.0.1:8080"  # host:port for HTTP
    api_keys_file: str = ""  # "" = no client authentication
    max_body_bytes: int = 8 * 1024 * 1024
    connect_timeout: Duration = 1.0
    first_byte_timeout: Duration = 300.0
    idle_timeout: Duration = 60.0
    # Mid-stream failover: a continuation's first byte is due within this long of the
    # break (every replica tried for it together); past it the stream ends with an error.
    failover_timeout: Duration = 30.0
    # A request head (request line and header fields) must be all in within this long,
    # from the connection for the first request, from its first byte for later ones: 408.
    header_timeout: Duration = 10.0
    eject_for: Duration = 10.0  # a replica that failed is skipped this long
    # Failures of a replica in a row, while another replica of the model answers, before
    # it is ejected (a burst in which every replica fails at once ejects none).
    eject_after: int = 3
    # Requests in flight per ready replica; beyond, requests wait in the model's queue.
    max_requests_per_replica: int = 1024
    # New engine connections being dialled at once per replica; more wait their turn.
    max_connecting_per_replica: int = 64
    # Per model: requests that may wait for a slot, and how long each may wait, before
    # being refused with 503 server_overloaded and Retry-After.
    queue_size: int = 1024
    queue_wait: Duration = 10.0
    # Priority classes, highest first, each with its own wait (queue_wait is then unused);
    # (): one class, "default", waiting queue_wait. `default_class`: the class of a key
    # that names none and of requests without a key; "": the first listed.
    classes: tuple[ClassConfig, ...] = ()
    default_class: str = ""
    metrics_interval: Duration = 0.25
    metrics_stale_after: Duration = 2.0
    table_poll_interval: Duration = 1.0
    # API keys kept by the server (API keys and limits): how often the router asks for their table
    # (a revoked key is refused within about this long).
    key_table_interval: Duration = 1.0
    # How often usage per key × model goes to the server (what a killed router loses).
    usage_report_interval: Duration = 5.0
    # Autoscale (elastic deployments): how often the router tells the server its load per model.
    load_report_interval: Duration = 5.0
    # A model scaled to zero: requests wait for its first replica, at most `hold_queue`
    # of them per model and each at most `cold_start_budget`; then 503 with Retry-After.
    hold_queue: int = 256
    cold_start_budget: Duration = 120.0
    # Per served model name; a model not listed uses ModelRouteConfig()'s defaults.
    models: dict[str, ModelRouteConfig] = field(factory=dict)
    source: str = ""
