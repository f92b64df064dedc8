"""The ops of API keys kept by the server (API keys and limits): what `ctl apikey` asks, and the key
table routers poll. Members of the Op union in requests.py.

The secret never travels: ctl makes it, prints it once and sends its SHA-256 and prefix.
Shapes are checked here, on decode (names, hashes, limits); what depends on the server's
state (a name in use, an unknown key, a date already past) is checked by the server.
"""

from __future__ import annotations

import enum
import re

from attrs import field, frozen

from llmgw.model.apikey import Budget, check_class, check_name
from llmgw.model.usage import UsageRow

MAX_LIMIT = 10**12  # rpm, tpm, concurrency, budget tokens: anything larger is a typo
MAX_MODELS = 1024  # model names one key may list
MAX_IMPORT = 4096  # keys one import may carry
# Keys the store may hold, revoked ones too: the key table travels in one message, and no
# list in a message is longer than codec.MAX_ITEMS (4096).
MAX_KEYS = 4096
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _name(_: object, __: object, value: str) -> None:
    why = check_name(value)
    if why:
        raise ValueError(f"name: {why}")


def _sha256(_: object, __: object, value: str) -> None:
    if not _HEX64.match(value):
        raise ValueError(f"sha256: expected 64 lowercase hex digits, got {value[:80]!r}")


def _limit(_: object, a: object, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_LIMIT:
        raise ValueError(f"{getattr(a, 'name', 'limit')}: expected 0 to {MAX_LIMIT}, got {value}")


def _count(_: object, a: object, value: int) -> None:
    _limit(_, a, value)


def _models(_: object, __: object, value: tuple[str, ...] | None) -> None:
    if value is None:
        return
    if len(value) > MAX_MODELS:
        raise ValueError(f"models: at most {MAX_MODELS}, got {len(value)}")
    for m in value:
        if not m or len(m) > 256:
            raise ValueError(f"models: expected names of 1 to 256 characters, got {m[:80]!r}")


def _budget(_: object, __: object, value: Budget | None) -> None:
    if value is not None and not (1 <= value.tokens <= MAX_LIMIT and 1.0 <= value.period <= 10 * 366 * 86400):
        raise ValueError(f"budget: expected 1 to {MAX_LIMIT} tokens per 1 s to 10 years, "
                         f"got {value.tokens} per {value.period:g}s")


def _when(_: object, a: object, value: float | None) -> None:
    if value is not None and not 0 <= value < 1e11:  # NaN fails too
        raise ValueError(f"{getattr(a, 'name', 'time')}: expected epoch seconds, got {value!r}")


ON_SERVER_LOSS = ("", "allow", "deny")


def _loss(_: object, __: object, value: str | None) -> None:
    if value is not None and value not in ON_SERVER_LOSS:
        raise ValueError(f"on_server_loss: expected allow, deny or \"\" (the default), got {value[:40]!r}")


def _class(_: object, __: object, value: str | None) -> None:
    if value:
        why = check_class(value)
        if why:
            raise ValueError(f"priority_class: {why}")


def _prefix(_: object, __: object, value: str) -> None:
    if len(value) > 16 or not re.match(r"^[A-Za-z0-9_-]*$", value):
        raise ValueError(f"prefix: expected at most 16 URL-safe characters, got {value[:40]!r}")


@frozen
class ApiKeyCreateOp:
    """A new key. `prefix` "" for an imported key (its secret was never seen here)."""

    name: str = field(validator=_name)
    sha256: str = field(validator=_sha256)
    prefix: str = field(default="", validator=_prefix)
    models: tuple[str, ...] = field(default=(), validator=_models)
    rpm: int = field(default=0, validator=_limit)
    tpm: int = field(default=0, validator=_limit)
    concurrency: int = field(default=0, validator=_limit)
    budget: Budget | None = field(default=None, validator=_budget)
    expires: float = field(default=0.0, validator=_when)
    on_server_loss: str = field(default="", validator=_loss)
    priority_class: str = field(default="", validator=_class)


@frozen
class ApiKeyUpdateOp:
    """Change what is given (None: leave as it is). `clear_budget` takes the budget off."""

    name: str = field(validator=_name)
    models: tuple[str, ...] | None = field(default=None, validator=_models)
    rpm: int | None = field(default=None, validator=_limit)
    tpm: int | None = field(default=None, validator=_limit)
    concurrency: int | None = field(default=None, validator=_limit)
    budget: Budget | None = field(default=None, validator=_budget)
    clear_budget: bool = False
    expires: float | None = field(default=None, validator=_when)  # 0: never
    on_server_loss: str | None = field(default=None, validator=_loss)
    priority_class: str | None = field(default=None, validator=_class)  # "": the default


@frozen
class ApiKeyRevokeOp:
    name: str = field(validator=_name)


@frozen
class ApiKeyListOp:
    """Every key (no hashes), or one in full with `name`."""

    name: str = ""


def _bounded_import(_: object, __: object, value: tuple[ApiKeyCreateOp, ...]) -> None:
    if len(value) > MAX_IMPORT:
        raise ValueError(f"an import carries at most {MAX_IMPORT} keys, got {len(value)}")


@frozen
class ApiKeyImportOp:
    """Keys of an api_keys_file (names, hashes, models), all or none."""

    keys: tuple[ApiKeyCreateOp, ...] = field(default=(), validator=_bounded_import)


@frozen
class KeyTableOp:
    """A router's poll: the key table, or only its version when it is `since`."""

    since: str = ""


def _rows(_: object, __: object, value: tuple[UsageRow, ...]) -> None:
    if len(value) > MAX_IMPORT:
        raise ValueError(f"a usage batch carries at most {MAX_IMPORT} rows, got {len(value)}")
    for r in value:
        if len(r.api_key) > 100 or len(r.model) > 256 or not 100 <= r.status <= 599:
            raise ValueError(f"usage row: a key of at most 100 characters, a model of at most "
                             f"256 and an HTTP status, got {r.api_key[:40]!r} {r.model[:40]!r} {r.status}")
        if min(r.requests, r.prompt_tokens, r.completion_tokens, r.hour) < 0 \
                or not 0 <= r.latency_sum < 1e12:
            raise ValueError("usage row: counts must not be negative")


def _batch_id(_: object, __: object, value: str) -> None:
    if not 8 <= len(value) <= 64:
        raise ValueError(f"batch_id: expected 8 to 64 characters, got {len(value)}")


@frozen
class UsageReportOp:
    """A router's usage since its last report; `batch_id` makes a retry count once."""

    batch_id: str = field(validator=_batch_id)
    rows: tuple[UsageRow, ...] = field(default=(), validator=_rows)


@frozen
class UsageOp:
    """Stored usage from the hour holding `since` (epoch seconds) on; "" : every key/model."""

    api_key: str = ""
    model: str = ""
    since: float = field(default=0.0, validator=_when)


class LimitKind(enum.StrEnum):
    RPM = "rpm"  # requests per minute
    TPM = "tpm"  # tokens per minute
    BUDGET = "budget"  # tokens per the key's budget period
    # Slots of the key's concurrency (server/tenants/slots.py): only in ops of their own,
    # which a server from before slots refuses whole (the router then counts alone).
    CONCURRENCY = "concurrency"


# A leader's term as routers see it (server/tenants/limits.py makes them): a router from
# before terms sends "" and is answered as before; NO_TERM is a router that knows terms and
# has not been told one yet (it holds no grant).
NO_TERM = "-"
_TERM = re.compile(r"^[0-9a-f-]{0,32}$")
MAX_HELD = 1024  # grants one LeaseOp declares (a router with more sends several)


def _term(_: object, __: object, value: str) -> None:
    if not _TERM.match(value):
        raise ValueError(f"term: expected at most 32 hex digits, got {value[:40]!r}")


@frozen
class Unused:
    """Units of a lease a router did not use and will not (the lease ended). `term`: the
    term that granted it; a leader of another term ignores it (its ids are not ours)."""

    key: str = field(validator=_name)
    kind: LimitKind
    grant_id: int = field(validator=_count)
    units: int = field(validator=_count)
    term: str = field(default="", validator=_term)


def _bounded_unused(_: object, __: object, value: tuple[Unused, ...]) -> None:
    if len(value) > MAX_IMPORT:
        raise ValueError(f"at most {MAX_IMPORT} leases given back at once, got {len(value)}")


def _seconds(_: object, a: object, value: float) -> None:
    if not -1e10 <= value <= 1e10:  # NaN fails too
        raise ValueError(f"{getattr(a, 'name', 'seconds')}: expected seconds, got {value!r}")


@frozen
class Held:
    """A grant of another term that a router holds or used (server/tenants/leases.py, adopt):
    `units` of it may occupy the limit; `left`: seconds of use it had left when the router
    sent this (negative: it ended that long ago). In a LeaseOp of kind CONCURRENCY, a slot
    grant the router holds, of any term: it keeps `units` slots of it (fewer give the rest
    back, 0 all) and renews it (server/tenants/slots.py); the answer's `kept` says what the
    server counts of each."""

    key: str = field(validator=_name)
    kind: LimitKind
    term: str = field(validator=_term)
    grant_id: int = field(validator=_count)
    units: int = field(validator=_count)
    left: float = field(validator=_seconds)


def _bounded_held(_: object, __: object, value: tuple[Held, ...]) -> None:
    if len(value) > MAX_HELD:
        raise ValueError(f"at most {MAX_HELD} grants declared at once, got {len(value)}")


def _bounded_kept(_: object, __: object, value: tuple[int, ...]) -> None:
    if len(value) > MAX_HELD:
        raise ValueError(f"at most {MAX_HELD} renewals answered at once, got {len(value)}")
    for n in value:
        _limit(_, __, n)


@frozen
class LeaseOp:
    """A router asks for `want` units of a key's limit (0: only gives back `unused`, or
    declares `held`). `term`: the leader's term the router last heard of ("" from a
    router before terms; NO_TERM: none yet). `held`: its grants of other terms, sent to a
    leader of a new term when told to (LeaseResult.declare)."""

    key: str = field(validator=_name)
    kind: LimitKind = LimitKind.RPM
    want: int = field(default=0, validator=_limit)
    unused: tuple[Unused, ...] = field(default=(), validator=_bounded_unused)
    term: str = field(default="", validator=_term)
    held: tuple[Held, ...] = field(default=(), validator=_bounded_held)


# ---- results ----


@frozen
class KeyEntry:
    """One key of the table a router polls: what admission needs, no prefix."""

    name: str = field(validator=_name)
    sha256: str = field(validator=_sha256)
    models: tuple[str, ...] = field(default=(), validator=_models)
    rpm: int = field(default=0, validator=_limit)
    tpm: int = field(default=0, validator=_limit)
    concurrency: int = field(default=0, validator=_limit)
    budget: Budget | None = field(default=None, validator=_budget)
    expires: float = field(default=0.0, validator=_when)
    revoked: float = field(default=0.0, validator=_when)
    on_server_loss: str = field(default="", validator=_loss)
    priority_class: str = field(default="", validator=_class)


@frozen
class KeyTableResult:
    """The answer to KeyTableOp: the whole table, or `unchanged` (the router has it)."""

    version: str
    keys: tuple[KeyEntry, ...] = ()
    unchanged: bool = False


@frozen
class LeaseResult:
    """The answer to LeaseOp: `units` for `ttl` seconds from when the router asked (0: none
    now; `retry_after` says when some are free again)."""

    grant_id: int = 0
    units: int = 0
    ttl: float = 0.0
    retry_after: float = 0.0
    # Only to a router that sent a term (an older one refuses keys it does not know):
    term: str = field(default="", validator=_term)  # the leader's term: names the grant
    declare: bool = False  # a new term: declare your grants of others (`held`), then ask
    hold: float = 0.0  # a new term waits this long for declarations: nothing granted yet
    # Only to an op of kind CONCURRENCY that renews slot grants (`held`), one per grant in
    # its order: the slots the server counts of it now (0: gone), live for `ttl` more.
    kept: tuple[int, ...] = field(default=(), validator=_bounded_kept)
