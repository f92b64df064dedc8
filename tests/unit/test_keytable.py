"""The router's copy of the server's key table (issue 24): versions, revoked and expired
keys, garbage from a client or the server, and the poll loop keeping the last table
while its source fails (on trio's autojump clock)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from llmgw.errors import ProtocolError
from llmgw.model.apikey import hash_secret
from llmgw.router.tenants.keytable import CACHE_MAX, KeyTable, poll_keys


def entry(name: str, secret: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "sha256": hash_secret(secret), **kw}


def bearer(secret: str) -> bytes:
    return b"Bearer " + secret.encode()


def test_check_by_hash_and_what_the_client_is_told() -> None:
    t = KeyTable()
    assert not t.in_use and not t.received
    assert t.apply({"version": "v1", "keys": [entry("a", "sa", models=["m"]),
                                              entry("r", "sr", revoked=5.0),
                                              entry("e", "se", expires=100.0,
                                                    on_server_loss="deny")]})
    assert t.in_use and t.received
    key, _ = t.check(bearer("sa"), 50.0)
    assert key is not None and key.name == "a" and key.allows("m") and not key.allows("x")
    assert t.check(bearer("sr"), 50.0) == (None, "This API key has been revoked.")
    e = t.check(bearer("se"), 50.0)[0]
    assert e is not None and e.on_server_loss == "deny"
    assert t.check(bearer("se"), 100.0) == (None, "This API key has expired.")
    assert t.check(bearer("nope"), 50.0) == (None, "Incorrect API key provided.")
    assert t.check(b"Basic c2E=", 50.0)[0] is None
    assert t.check(None, 50.0)[0] is None
    # Unchanged, or the same version again: nothing to do.
    assert not t.apply({"version": "v1", "unchanged": True})
    assert not t.apply({"version": "v1", "keys": []})
    # A new version replaces the table, cached answers with it.
    assert t.apply({"version": "v2", "keys": [entry("a", "sa", revoked=7.0)]})
    assert t.check(bearer("sa"), 50.0) == (None, "This API key has been revoked.")


@pytest.mark.parametrize("bad", [
    {"version": "v9", "keys": [{"name": "a", "sha256": "short"}]},
    {"version": "v9", "keys": [entry("a", "s", rpm=-1)]},
    {"version": "v9", "keys": "all"},
    {"keys": []},
    [],
])
def test_a_malformed_table_changes_nothing(bad: Any) -> None:
    t = KeyTable()
    t.apply({"version": "v1", "keys": [entry("a", "sa")]})
    with pytest.raises(ProtocolError):
        t.apply(bad)
    assert t.version == "v1" and t.check(bearer("sa"), 0.0)[0] is not None


def test_garbage_keys_cost_a_bounded_cache() -> None:
    t = KeyTable()
    t.apply({"version": "v1", "keys": [entry("a", "sa")]})
    for i in range(CACHE_MAX * 2 + 3):
        assert t.check(b"Bearer junk-%d" % i, 0.0)[0] is None
    assert len(t._cache) <= CACHE_MAX
    assert t.check(bearer("sa"), 0.0)[0] is not None


async def test_poll_keeps_the_last_table_while_the_source_fails(autojump_clock: trio.abc.Clock) -> None:
    t = KeyTable()
    answers: list[Any] = [{"version": "v1", "keys": [entry("a", "sa")]}, OSError("down"),
                          OSError("down"), {"version": "v1", "unchanged": True},
                          {"version": "v2", "keys": []}]
    asked: list[str] = []

    async def source(since: str) -> Any:
        asked.append(since)
        a = answers.pop(0) if answers else {"version": "v2", "unchanged": True}
        if isinstance(a, Exception):
            raise a
        return a

    async with trio.open_nursery() as n:
        await n.start(poll_keys, t, source, 1.0)
        assert t.version == "v1"  # started after the first answer
        await trio.sleep(2.5)
        assert t.version == "v1" and t.in_use  # the source is failing: the last table
        await trio.sleep(2.0)
        assert t.version == "v2" and not t.in_use
        n.cancel_scope.cancel()
    assert asked[:5] == ["", "v1", "v1", "v1", "v1"]


def test_key_table_interval_in_router_toml(tmp_path: Any) -> None:
    from llmgw.config.load_router import load_router_config
    from llmgw.errors import ConfigError

    f = tmp_path / "router.toml"
    f.write_text('server = "tcp://127.0.0.1:7443"\nkey_table_interval = "10ms"\n'
                 '[keys]\nsecret_key = "/no/r.key_secret"\nserver_key = "/no/server.key"\n')
    with pytest.raises(ConfigError, match="key_table_interval.*at least 100ms"):
        load_router_config(str(f))


def test_a_keys_priority_class_comes_with_the_table() -> None:
    t = KeyTable()
    t.apply({"version": "v1", "keys": [entry("a", "sa", priority_class="batch"), entry("b", "sb")]})
    a, b = t.check(bearer("sa"), 0.0)[0], t.check(bearer("sb"), 0.0)[0]
    assert a is not None and a.priority_class == "batch"
    assert b is not None and b.priority_class == ""  # a server from before sends none
    with pytest.raises(ProtocolError):
        t.apply({"version": "v2", "keys": [entry("a", "sa", priority_class="NOT A CLASS")]})
