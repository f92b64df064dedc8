"""A Ray gang whose members each hold the model at the same path starts on it (issue 23):
the server names the path every member holds complete (server/placement/gang_weights.py),
the spec carries it (GangSpec.weights_path), and the head's agent uses it once its own
scan confirms it (agent/engines/weights.py)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import attrs
import msgpack

from fakes.cluster import cluster, node
from llmgw.agent.engines.weights import HF_CACHE_ENV, HF_OFFLINE_ENV, resolve_weights, weights_for
from llmgw.config.agent import AgentConfig, EnginesConfig, KeysConfig, VllmConfig
from llmgw.model.deployment import Deployment, Replica
from llmgw.model.engine import EngineKind, EngineReport, EngineSpec, EngineState, GangSpec
from llmgw.model.inventory import ModelCopy, StorageReport
from llmgw.server.placement.gang_weights import gang_weights_path
from llmgw.server.placement.place import Placement, place
from llmgw.server.reconcile.rebuild import rebuild
from llmgw.server.reconcile.rules import reconcile
from llmgw.server.store.sql import Store
from llmgw.transport.codec import decode, encode
from llmgw.transport.messages import DesiredSet

LOCAL = ModelCopy("org/x", "/data/org/x", 5 << 20, True)
SNAP = "/mnt/weka/hf/models--org--x/snapshots/abc"
SHARED = ModelCopy("org/x", SNAP, 5 << 20, True, shared=True, store="weka-a")


def scan(*copies: ModelCopy) -> StorageReport:
    return StorageReport(True, copies)


# ---- the pure choice over the members' scans ----


def test_a_path_every_member_holds_complete_is_chosen() -> None:
    assert gang_weights_path("org/x", [scan(LOCAL), scan(LOCAL), scan(LOCAL)]) == "/data/org/x"
    # A trailing slash in one scan is the same folder.
    assert gang_weights_path("org/x", [scan(LOCAL), scan(attrs.evolve(LOCAL, path="/data/org/x/"))]) \
        == "/data/org/x"


def test_one_member_with_an_incomplete_copy_gives_none() -> None:
    half = attrs.evolve(LOCAL, complete=False, reason="partial download")
    assert gang_weights_path("org/x", [scan(LOCAL), scan(half)]) == ""
    assert gang_weights_path("org/x", [scan(half), scan(LOCAL)]) == ""


def test_different_paths_on_different_members_give_none() -> None:
    elsewhere = attrs.evolve(LOCAL, path="/nvme/org/x")
    assert gang_weights_path("org/x", [scan(LOCAL), scan(elsewhere)]) == ""
    # Another snapshot (revision) of a cache is another path too.
    other_rev = attrs.evolve(SHARED, path=SNAP.replace("abc", "def"))
    assert gang_weights_path("org/x", [scan(SHARED), scan(other_rev)]) == ""


def test_a_shared_copy_every_member_sees_is_chosen() -> None:
    assert gang_weights_path("org/x", [scan(SHARED), scan(SHARED)]) == SNAP


def test_local_on_every_member_before_shared_then_the_heads_scan_order() -> None:
    nvme = attrs.evolve(LOCAL, path="/nvme/org/x")
    head = scan(SHARED, nvme, LOCAL)
    assert gang_weights_path("org/x", [head, scan(LOCAL, SHARED, nvme)]) == "/nvme/org/x"
    # /data is a filer on the member: the path local on both wins over it.
    member = scan(attrs.evolve(LOCAL, shared=True, store="nfs"), SHARED, nvme)
    assert gang_weights_path("org/x", [scan(LOCAL, nvme), member]) == "/nvme/org/x"
    # ... and of two paths, one shared on a member, is still taken before one shared on all.
    assert gang_weights_path("org/x", [scan(SHARED, LOCAL), scan(SHARED, member.models[0])]) \
        == "/data/org/x"


def test_none_held_no_scan_or_a_path_gives_none() -> None:
    assert gang_weights_path("org/x", []) == ""
    assert gang_weights_path("org/x", [scan(), scan()]) == ""
    assert gang_weights_path("org/x", [scan(LOCAL), None]) == ""
    assert gang_weights_path("org/x", [scan(LOCAL), StorageReport(False)]) == ""
    assert gang_weights_path("org/y", [scan(LOCAL), scan(LOCAL)]) == ""
    assert gang_weights_path("/data/org/x", [scan(LOCAL), scan(LOCAL)]) == ""


# ---- the server: placement names it, the replica keeps it, the specs carry it ----


GANG = Deployment("g", "org/m", EngineKind.VLLM, 8, 1, nodes=2)


def test_placement_names_the_path_both_members_hold() -> None:
    both = cluster(node("a", fabrics=["ib"], holds=["org/m"]), node("b", fabrics=["ib"], holds=["org/m"]))
    p = place(GANG, both)
    assert isinstance(p, Placement) and p.weights_path == "/models/org/m"
    one = cluster(node("a", fabrics=["ib"], holds=["org/m"]), node("b", fabrics=["ib"]))
    p = place(GANG, one)
    assert isinstance(p, Placement) and p.holders == 1 and p.weights_path == ""
    single = place(attrs.evolve(GANG, nodes=1), both)
    assert isinstance(single, Placement) and single.weights_path == ""


def test_every_members_spec_carries_it_and_a_rebuild_keeps_it() -> None:
    views = cluster(node("a", fabrics=["ib"], holds=["org/m"]), node("b", fabrics=["ib"], holds=["org/m"]))
    placed = reconcile({"g": GANG}, {}, views, {}, 0.0).replicas
    r = placed["g-0"]
    assert r.gang_weights == "/models/org/m"
    specs = r.engine_specs()
    assert [s.gang.weights_path for s in specs if s.gang] == ["/models/org/m"] * 2
    # A server that lost its state rebuilds the replica from the specs the engines run.
    reports = {m.node_id: (EngineReport(r.id, r.generation, EngineState.READY, spec=s),)
               for m, s in zip(r.members, specs, strict=True)}
    addrs = {n: v.info.mgmt_addr for n, v in views.items()}
    res = rebuild({}, {}, reports, addrs, 0, 1.0)
    assert res.replicas["g-0"].gang_weights == "/models/org/m"
    assert res.replicas["g-0"].engine_specs() == specs


def test_the_store_keeps_it_and_reads_a_row_from_before(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    r = Replica(id="g-0", deployment="g", index=0, spec=GANG, generation=2, gang_weights="/data/org/m")
    with Store(path) as s:
        s.save_replicas({"g-0": r})
    with Store(path) as s:
        assert s.replicas() == {"g-0": r}
    db = sqlite3.connect(path)
    (data,) = db.execute("SELECT data FROM replicas WHERE id = 'g-0'").fetchone()
    old = {k: v for k, v in json.loads(data).items() if k != "gang_weights"}
    with db:
        db.execute("UPDATE replicas SET data = ? WHERE id = 'g-0'", (json.dumps(old),))
    db.close()
    with Store(path) as s:
        assert s.replicas() == {"g-0": attrs.evolve(r, gang_weights="")}


# ---- the wire ----


SPEC = EngineSpec("g-0", 2, "g", "org/x", "x", EngineKind.VLLM, ("GPU-a",), 20001,
                  gang=GangSpec(2, 0, "10.0.0.1", 20002, ray_port=20003, ray_port_base=21000))


def _gang_on_wire(spec: EngineSpec) -> dict[str, object]:
    raw = msgpack.unpackb(encode(DesiredSet(1, (spec,))))
    gang: dict[str, object] = raw["engines"][0]["gang"]
    return gang


def test_the_key_goes_only_when_there_is_a_path() -> None:
    assert "weights_path" not in _gang_on_wire(SPEC)  # as before the key existed
    with_path = attrs.evolve(SPEC, gang=attrs.evolve(SPEC.gang, weights_path="/data/org/x"))
    assert _gang_on_wire(with_path)["weights_path"] == "/data/org/x"
    assert decode(encode(DesiredSet(1, (with_path,)))) == DesiredSet(1, (with_path,))


def test_a_spec_from_a_server_before_reads_as_none() -> None:
    raw = msgpack.unpackb(encode(DesiredSet(1, (SPEC,))))
    raw["engines"][0]["gang"].pop("weights_path", None)
    got = decode(msgpack.packb(raw))
    assert isinstance(got, DesiredSet) and got.engines[0].gang is not None
    assert got.engines[0].gang.weights_path == "" and got.engines[0] == SPEC


# ---- the agent: uses it where its own scan confirms it ----


def test_a_gang_uses_the_local_copy_every_member_holds() -> None:
    w = resolve_weights("org/x", scan(LOCAL), "/dl", shared_only=True, gang_path="/data/org/x")
    assert (w.arg, w.copy, w.env, w.download_dir) == ("/data/org/x", LOCAL, {}, "")
    assert w.reason == "org/x: local plain tree /data/org/x, held complete by every member of the gang"
    hf_local = ModelCopy("org/x", "/nvme/hf/models--org--x/snapshots/abc", 1, True)
    w = resolve_weights("org/x", scan(SHARED, hf_local), "", shared_only=True, gang_path=hf_local.path + "/")
    assert w.copy == hf_local and w.env == {HF_CACHE_ENV: "/nvme/hf", HF_OFFLINE_ENV: "1"}


def test_a_path_not_complete_here_falls_back_and_says_why() -> None:
    half = attrs.evolve(LOCAL, complete=False, reason="no config.json")
    w = resolve_weights("org/x", scan(half), "/dl", shared_only=True, gang_path="/data/org/x")
    assert (w.arg, w.copy, w.download_dir) == ("org/x", None, "/dl")
    assert w.reason == ("org/x: the copy every member of the gang held at /data/org/x is incomplete "
                        "here (no config.json); downloading into /dl")
    # Not in this scan at all, with a shared copy: the shared copy, and why not the other.
    w = resolve_weights("org/x", scan(SHARED), "/dl", shared_only=True, gang_path="/data/org/x")
    assert w.copy == SHARED
    assert w.reason == (f"org/x: shared HF cache {SNAP} (store weka-a) (the copy every member of the "
                        "gang held at /data/org/x is not in this node's scan)")
    # A local copy elsewhere still does not qualify for a gang.
    other = attrs.evolve(LOCAL, path="/nvme/org/x")
    w = resolve_weights("org/x", scan(other), "/dl", shared_only=True, gang_path="/data/org/x")
    assert w.copy is None and "not in this node's scan" in w.reason


def test_without_a_path_a_gang_takes_only_shared_copies_as_before() -> None:
    w = resolve_weights("org/x", scan(LOCAL), "/dl", shared_only=True)
    assert w.copy is None and "only a shared copy, or a path every member holds complete" in w.reason


def _config(mode: str) -> AgentConfig:
    return AgentConfig(node_id="n1", server="tcp://10.0.0.9:5555", keys=KeysConfig("s", "p"),
                       mgmt_addr="10.0.0.2",
                       engines=EnginesConfig(vllm=VllmConfig(launch_mode=mode)))  # type: ignore[arg-type]


def test_weights_for_a_ray_gang_takes_the_path_from_its_spec() -> None:
    spec = attrs.evolve(SPEC, gang=attrs.evolve(SPEC.gang, weights_path="/data/org/x"))
    assert weights_for(spec, _config("ray"), scan(LOCAL)).copy == LOCAL
    assert weights_for(SPEC, _config("ray"), scan(LOCAL)).copy is None  # from a server before
    # mp: every member runs its own engine on its own copy, as before.
    assert weights_for(SPEC, _config("mp"), scan(LOCAL)).copy == LOCAL


def test_a_gang_taken_off_its_nodes_forgets_it() -> None:
    views = cluster(node("a", fabrics=["ib"], holds=["org/m"]), node("b", fabrics=["ib"], holds=["org/m"]))
    r = reconcile({"g": GANG}, {}, views, {}, 0.0).replicas["g-0"]
    died = {"a": (EngineReport(r.id, r.generation, EngineState.EXITED, exit_code=1),)}
    after = reconcile({"g": GANG}, {"g-0": r}, views, died, 1.0).replicas["g-0"]
    assert not after.placed and after.gang_weights == ""
