"""The server's API key ops (issue 24) over a real SQLite store: create, update, revoke,
list, import, and the key table routers poll (its version, what it carries)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from llmgw.model.apikey import Budget, hash_secret
from llmgw.server.peers.sessions import Peer, RequestError
from llmgw.server.store.sql import Store
from llmgw.server.tenants.apikeys import ApiKeys
from llmgw.transport.apikey_ops import (
    ApiKeyCreateOp,
    ApiKeyImportOp,
    ApiKeyListOp,
    ApiKeyRevokeOp,
    ApiKeyUpdateOp,
    KeyTableOp,
    LeaseOp,
    UsageReportOp,
)

ADMIN = Peer(b"r", "admin", "ops")
ROUTER = Peer(b"r", "router", "r1")
NOW = 1_800_000_000.0


def create(name: str, secret: str = "", **kw: object) -> ApiKeyCreateOp:
    return ApiKeyCreateOp(name, hash_secret(secret or f"s-{name}"), "llmgw-abcdef", **kw)  # type: ignore[arg-type]


def run(coro_fn, *args):  # type: ignore[no-untyped-def]
    return trio.run(coro_fn, *args)


def test_create_list_update_revoke_and_the_table_follows(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "s.db"))
    keys = ApiKeys(store)
    empty = keys.op_key_table(ROUTER, KeyTableOp(), NOW)
    assert empty["keys"] == []
    out = run(keys.op_create, ADMIN, create("team-a", models=("m1",), rpm=10,
                                            budget=Budget(5000, 86400.0)), NOW)
    assert out["state"] == "active" and out["prefix"] == "llmgw-abcdef"
    assert "sha256" not in out  # a listing never carries the hash
    t1 = keys.op_key_table(ROUTER, KeyTableOp(empty["version"]), NOW)
    assert t1["version"] != empty["version"]
    assert t1["keys"] == [{"name": "team-a", "sha256": hash_secret("s-team-a"), "models": ["m1"],
                           "rpm": 10, "tpm": 0, "concurrency": 0,
                           "budget": {"tokens": 5000, "period": 86400.0}, "expires": 0.0,
                           "revoked": 0.0}]
    # Asked with the version it has: only that it is unchanged.
    assert keys.op_key_table(ROUTER, KeyTableOp(t1["version"]), NOW) == {
        "version": t1["version"], "unchanged": True}
    upd = run(keys.op_update, ADMIN, ApiKeyUpdateOp("team-a", rpm=20, clear_budget=True), NOW)
    assert upd["rpm"] == 20 and upd["budget"] is None and upd["models"] == ["m1"]
    rev = run(keys.op_revoke, ADMIN, ApiKeyRevokeOp("team-a"), NOW + 5)
    assert rev["state"] == "revoked"
    t2 = keys.op_key_table(ROUTER, KeyTableOp(t1["version"]), NOW)
    assert t2["keys"][0]["revoked"] == NOW + 5
    # Persisted: a server started on the same store serves the same table, same version.
    again = ApiKeys(Store(str(tmp_path / "s.db")))
    assert again.op_key_table(ROUTER, KeyTableOp(), NOW) == t2
    assert [k["name"] for k in again.op_list(ADMIN, ApiKeyListOp(), NOW)] == ["team-a"]


def test_refusals_name_what_is_wrong(tmp_path: Path) -> None:
    keys = ApiKeys(Store(str(tmp_path / "s.db")))
    run(keys.op_create, ADMIN, create("a"), NOW)
    with pytest.raises(RequestError, match="exists"):
        run(keys.op_create, ADMIN, create("a", secret="other"), NOW)
    with pytest.raises(RequestError, match="already another key's"):
        run(keys.op_create, ADMIN, create("b", secret="s-a"), NOW)
    with pytest.raises(RequestError, match="in the past"):
        run(keys.op_create, ADMIN, create("c", expires=NOW - 1), NOW)
    with pytest.raises(RequestError, match="no API key named 'zz'"):
        run(keys.op_revoke, ADMIN, ApiKeyRevokeOp("zz"), NOW)
    with pytest.raises(RequestError, match="no API key named"):
        keys.op_list(ADMIN, ApiKeyListOp("zz"), NOW)
    run(keys.op_revoke, ADMIN, ApiKeyRevokeOp("a"), NOW)
    with pytest.raises(RequestError, match="revoked"):
        run(keys.op_update, ADMIN, ApiKeyUpdateOp("a", rpm=1), NOW)


def test_import_is_all_or_nothing(tmp_path: Path) -> None:
    keys = ApiKeys(Store(str(tmp_path / "s.db")))
    run(keys.op_create, ADMIN, create("taken"), NOW)
    bad = ApiKeyImportOp((ApiKeyCreateOp("x", hash_secret("x")), ApiKeyCreateOp("taken", hash_secret("y"))))
    with pytest.raises(RequestError, match="'taken' exists"):
        run(keys.op_import, ADMIN, bad, NOW)
    assert sorted(keys.keys) == ["taken"]
    ok = ApiKeyImportOp((ApiKeyCreateOp("x", hash_secret("x"), models=("m",)),))
    assert run(keys.op_import, ADMIN, ok, NOW) == {"imported": ["x"]}
    assert keys.keys["x"].prefix == "" and keys.keys["x"].models == ("m",)


def test_only_routers_and_admins_read_the_table(tmp_path: Path) -> None:
    ops = ApiKeys(Store(str(tmp_path / "s.db"))).ops()
    assert ops[KeyTableOp][0] == {"router", "admin"}
    assert ops[UsageReportOp][0] == {"router"}  # only a router's usage is counted
    assert ops[LeaseOp][0] == {"router"}
    assert all(roles == {"admin"} for op, (roles, _) in ops.items()
               if op not in (KeyTableOp, UsageReportOp, LeaseOp))


def test_a_budget_book_starts_from_the_stored_usage(tmp_path: Path) -> None:
    from llmgw.model.usage import UsageRow
    from llmgw.transport.apikey_ops import LeaseOp, LimitKind

    store = Store(str(tmp_path / "s.db"))
    keys = ApiKeys(store)
    run(keys.op_create, ADMIN, create("b", budget=Budget(100, 86400.0)), NOW)
    store.add_usage("batch-0001", [UsageRow("b", "m", int(NOW // 3600 * 3600), 200, 3, 50, 40)], NOW)
    # A server started afresh (a restart, a failover): the budget's book remembers 90 spent.
    again = ApiKeys(Store(str(tmp_path / "s.db")))

    async def ask(want: int) -> dict[str, float]:
        got = again.limits.op_lease(ROUTER, LeaseOp("b", LimitKind.BUDGET, want), NOW + 60)
        return await got if not isinstance(got, dict) else got  # type: ignore[no-any-return]
    assert trio.run(ask, 50)["units"] == 10
    assert trio.run(ask, 5)["retry_after"] > 0
    # Rates do not read the store: answered at once.
    run(again.op_update, ADMIN, ApiKeyUpdateOp("b", rpm=5), NOW)
    assert again.limits.op_lease(ROUTER, LeaseOp("b", LimitKind.RPM, 2), NOW)["units"] == 2


def test_a_keys_priority_class_is_kept_listed_and_sent_to_routers(tmp_path: Path) -> None:
    keys = ApiKeys(Store(str(tmp_path / "s.db")))
    out = run(keys.op_create, ADMIN, create("a", priority_class="batch"), NOW)
    assert out["priority_class"] == "batch"
    run(keys.op_create, ADMIN, create("b"), NOW)
    rows = {e["name"]: e for e in keys.op_key_table(ROUTER, KeyTableOp(), NOW)["keys"]}
    assert rows["a"]["priority_class"] == "batch"
    assert "priority_class" not in rows["b"]  # only when set: a router from before reads the rest
    upd = run(keys.op_update, ADMIN, ApiKeyUpdateOp("a", priority_class=""), NOW)
    assert upd["priority_class"] == "default"
    assert ApiKeys(Store(str(tmp_path / "s.db"))).op_list(ADMIN, ApiKeyListOp(), NOW)[0][
        "priority_class"] == "default"
    with pytest.raises(ValueError, match="priority_class"):
        create("c", priority_class="Batch")
