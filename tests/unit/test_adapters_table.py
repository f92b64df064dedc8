"""The router's endpoint table with LoRA adapters: an adapter's pool holds the replicas of
its base that have it loaded, the same Replica objects as the base's pool."""

from __future__ import annotations

from llmgw.router.routing.table import EndpointTable


def _snap(version: int, models: dict, waiting: dict | None = None) -> dict:
    return {"version": version, "models": models, "waiting": waiting or {}}


def test_an_adapter_goes_only_where_it_is_loaded() -> None:
    t = EndpointTable(policies={"llama": (True, 64)})
    t.apply(_snap(1, {"llama": [
        {"replica_id": "llama-0", "url": "http://10.0.0.1:20001", "ready": True, "adapters": ["sql"]},
        {"replica_id": "llama-1", "url": "http://10.0.0.2:20001", "ready": True},
    ]}))
    assert [r.replica_id for r in t.pools["sql"].replicas] == ["llama-0"]
    assert t.pools["sql"].replicas[0] is t.replicas["llama-0"]  # one in-flight count for both
    assert t.bases == {"sql": "llama"}
    assert t.pools["sql"].affinity and t.pools["sql"].prefix_chars == 64  # the base's policy
    assert t.ready_models() == ["llama", "sql"]
    # Unloaded everywhere: the adapter is gone from the table, as an unknown model is.
    t.apply(_snap(2, {"llama": [{"replica_id": "llama-0", "url": "http://10.0.0.1:20001"}]}))
    assert "sql" not in t.pools and t.bases == {} and t.ready_models() == ["llama"]


def test_a_served_name_wins_over_an_adapter_of_that_name() -> None:
    t = EndpointTable()
    t.apply(_snap(1, {
        "llama": [{"replica_id": "llama-0", "url": "http://10.0.0.1:20001", "adapters": ["qwen", "sql"]}],
        "qwen": [{"replica_id": "qwen-0", "url": "http://10.0.0.3:20001"}],
    }))
    assert [r.replica_id for r in t.pools["qwen"].replicas] == ["qwen-0"]
    assert t.bases == {"sql": "llama"}


def test_a_table_from_a_server_before_adapters_still_reads() -> None:
    t = EndpointTable()
    assert t.apply(_snap(1, {"llama": [{"replica_id": "llama-0", "url": "http://10.0.0.1:20001"}]}))
    assert t.bases == {} and list(t.pools) == ["llama"]
