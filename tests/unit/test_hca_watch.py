"""The HCA watch (issue 22): a labelled HCA's port that leaves ACTIVE or whose error
counters jump is a problem at once, cleared only once the port is ACTIVE and quiet; the
server then stops counting that HCA in its fabric."""

from __future__ import annotations

import functools
from pathlib import Path

import attrs
import trio

from fakes.cluster import cluster, node
from fakes.sysfs import PHYS, STATES, add_hca
from llmgw.agent.discovery.hca_watch import (
    HcaHealth,
    PortSample,
    parse_counter,
    read_samples,
    serve_hca_watch,
)
from llmgw.model.deployment import Deployment
from llmgw.model.engine import EngineKind
from llmgw.model.inventory import FabricReport, FabricState, Hca, IbPort, Inventory
from llmgw.server.placement.fabrics import sick_hcas, usable_fabrics
from llmgw.server.placement.place import Placement, place


def counters(root: Path, hca: str, port: int = 1, **values: int) -> None:
    d = root / hca / "ports" / str(port) / "counters"
    d.mkdir(parents=True, exist_ok=True)
    for k, v in values.items():
        (d / k).write_text(f"{v}\n")


def set_state(root: Path, hca: str, state: str, port: int = 1) -> None:
    (root / hca / "ports" / str(port) / "state").write_text(STATES[state] + "\n")
    (root / hca / "ports" / str(port) / "phys_state").write_text(PHYS[state] + "\n")


def active(hca: str = "mlx5_0", port: int = 1, **c: int) -> PortSample:
    return PortSample(hca, port, "ACTIVE", "LinkUp", 200.0, c)


def test_read_samples_from_sysfs(tmp_path: Path) -> None:
    add_hca(tmp_path, "mlx5_0", states=("ACTIVE", "DOWN"))
    counters(tmp_path, "mlx5_0", 1, link_downed=3, symbol_error=12, port_rcv_errors=0)
    (tmp_path / "mlx5_0" / "ports" / "1" / "counters" / "link_error_recovery").write_text("junk\n")
    s1, s2, gone = read_samples(str(tmp_path), ("mlx5_0", "mlx5_9"))
    assert (s1.port, s1.state, s1.phys_state, s1.rate_gbps) == (1, "ACTIVE", "LinkUp", 200.0)
    assert s1.counters == {"link_downed": 3, "symbol_error": 12, "port_rcv_errors": 0}
    assert (s2.port, s2.state, s2.phys_state, s2.counters) == (2, "DOWN", "Disabled", {})
    assert gone == PortSample("mlx5_9", 0, "")
    assert [parse_counter(x) for x in ("7\n", "", "-1", "x")] == [7, None, None, None]


def test_down_is_a_problem_at_once_and_clears_after_quiet() -> None:
    h = HcaHealth(quiet=10)
    assert not h.observe([active()], 0) and h.problems == {}
    assert h.observe([PortSample("mlx5_0", 1, "DOWN", "Disabled")], 2)
    assert h.problems == {"mlx5_0": ("port 1 DOWN (Disabled)",)}
    assert not h.observe([PortSample("mlx5_0", 1, "DOWN", "Disabled")], 4)  # no news
    # Back: still out until it has been ACTIVE and quiet for `quiet` seconds.
    assert h.observe([active()], 6)
    assert h.problems == {"mlx5_0": ("port 1 DOWN (Disabled); counts again after 10s ACTIVE and quiet",)}
    assert not h.observe([active()], 12)
    assert h.observe([active()], 14) and h.problems == {}


def test_counter_jumps_past_their_limits() -> None:
    h = HcaHealth(quiet=5)
    h.observe([active(symbol_error=10, link_downed=0)], 0)
    assert not h.observe([active(symbol_error=60, link_downed=0)], 2)  # +50: under 100
    assert h.observe([active(symbol_error=300, link_downed=0)], 4)
    assert h.problems == {"mlx5_0": ("port 1 symbol_error +240 in 2s",)}
    h = HcaHealth(quiet=5)
    h.observe([active(link_downed=4)], 0)
    assert h.observe([active(link_downed=5)], 2)  # a flap: any rise
    assert h.problems["mlx5_0"] == ("port 1 link_downed +1 in 2s",)
    # A fall is a reset (perfquery -R): a new baseline, no problem of its own.
    h = HcaHealth(quiet=5)
    h.observe([active(symbol_error=900)], 0)
    assert not h.observe([active(symbol_error=0)], 2)
    assert not h.observe([active(symbol_error=50)], 4)


def test_gone_and_two_hcas_apart() -> None:
    h = HcaHealth()
    assert h.observe([PortSample("mlx5_1", 0, ""), active("mlx5_0")], 0)
    assert h.problems == {"mlx5_1": ("not found in sysfs",)}
    inv = Inventory(hcas=(Hca("mlx5_0", "g"), Hca("mlx5_1", "g")))
    assert [x.problems for x in h.apply(inv).hcas] == [(), ("not found in sysfs",)]


async def _read_inline(root: str, hcas: tuple[str, ...]) -> tuple[PortSample, ...]:
    """The default reader without its thread: the mock clock cannot jump past a thread."""
    return read_samples(root, hcas)


async def test_the_watch_reports_a_port_going_down_within_an_interval(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    add_hca(tmp_path, "mlx5_0")
    add_hca(tmp_path, "mlx5_1")
    health = HcaHealth(quiet=6)
    changes: list[float] = []
    async with trio.open_nursery() as n:
        await n.start(functools.partial(serve_hca_watch, read=_read_inline), str(tmp_path),
                      ("mlx5_0", "mlx5_1"), health, lambda: changes.append(trio.current_time()), 2.0)
        await trio.sleep(5)
        assert changes == []
        set_state(tmp_path, "mlx5_1", "DOWN")
        down_at = trio.current_time()
        await trio.sleep(2.5)
        assert len(changes) == 1 and changes[0] - down_at <= 2.0
        assert health.problems == {"mlx5_1": ("port 1 DOWN (Disabled)",)}
        set_state(tmp_path, "mlx5_1", "ACTIVE")
        await trio.sleep(10)
        assert health.problems == {} and len(changes) == 3  # down, back (waiting), clear
        n.cancel_scope.cancel()


def _inv(*hcas: Hca, state: FabricState = FabricState.UP) -> Inventory:
    return Inventory(hcas=hcas, fabrics=(FabricReport("ib", ("mlx5_0", "mlx5_1"), state, 200),))


def _hca(name: str, *problems: str, port: str = "ACTIVE") -> Hca:
    return Hca(name, "g", (IbPort(1, port, "LinkUp", 200, "InfiniBand", "fe80"),), problems=problems)


def test_the_server_counts_only_healthy_hcas() -> None:
    ok = usable_fabrics(_inv(_hca("mlx5_0"), _hca("mlx5_1")))
    assert ok["ib"].hcas == ("mlx5_0", "mlx5_1")
    one = usable_fabrics(_inv(_hca("mlx5_0", "port 1 DOWN (Disabled)"), _hca("mlx5_1")))
    assert one["ib"].hcas == ("mlx5_1",)
    # An older agent without the watch: a port not active still keeps the HCA out.
    assert usable_fabrics(_inv(_hca("mlx5_0", port="DOWN"), _hca("mlx5_1")))["ib"].hcas == ("mlx5_1",)
    assert usable_fabrics(_inv(_hca("mlx5_0", "x"), _hca("mlx5_1", "y"))) == {}
    assert usable_fabrics(_inv(_hca("mlx5_0"), _hca("mlx5_1"), state=FabricState.DOWN)) == {}
    inv = _inv(_hca("mlx5_0", "port 1 DOWN (Disabled)"), _hca("mlx5_1"))
    assert sick_hcas(inv, ("mlx5_0", "mlx5_1")) == ["mlx5_0 (port 1 DOWN (Disabled))"]


def test_a_gang_is_placed_on_healthy_hcas_only() -> None:
    def with_hcas(view: object, *hcas: Hca) -> object:
        return attrs.evolve(view, inventory=attrs.evolve(view.inventory, hcas=hcas))  # type: ignore[attr-defined]

    a = with_hcas(node("a", fabrics=["ib"]), _hca("mlx5_0", "port 1 DOWN (Disabled)"), _hca("mlx5_1"))
    b = with_hcas(node("b", fabrics=["ib"]), _hca("mlx5_0"), _hca("mlx5_1"))
    c = with_hcas(node("c", fabrics=["ib"]), _hca("mlx5_0", "x"), _hca("mlx5_1", "y"))
    d = Deployment(name="d", model="org/m", gpus_per_node=8, replicas=1, nodes=2, engine=EngineKind.VLLM)
    p = place(d, cluster(a, b, c))  # type: ignore[arg-type]
    assert isinstance(p, Placement), p
    assert {m.node_id: m.hcas for m in p.members} == {"a": ("mlx5_1",), "b": ("mlx5_0", "mlx5_1")}


def test_an_hca_gone_after_start_is_reported_not_hidden(tmp_path: Path) -> None:
    from llmgw.agent.discovery.hca_watch import GONE, with_gone, without_hcas
    from llmgw.config.agent import AgentConfig, FabricConfig, KeysConfig

    cfg = AgentConfig(node_id="n", server="tcp://127.0.0.1:1", keys=KeysConfig("k", "s"),
                      mgmt_addr="127.0.0.1",
                      fabrics=(FabricConfig("ib", ("mlx5_0", "mlx5_1"), 200),))
    h = HcaHealth()
    h.observe([active("mlx5_0"), active("mlx5_1")], 0)
    assert h.gone() == frozenset()
    h.observe([active("mlx5_0"), PortSample("mlx5_1", 0, "")], 2)
    assert h.gone() == {"mlx5_1"}
    reduced = without_hcas(cfg, h.gone())
    assert reduced.fabrics[0].hcas == ("mlx5_0",)
    # What discovery finds under the reduced labels, then the gone HCA put back as such.
    found = Inventory(hcas=(_hca("mlx5_0"),), fabrics=(FabricReport("ib", ("mlx5_0",), FabricState.UP, 200),))
    inv = with_gone(found, cfg, h.gone())
    assert [(x.name, x.problems) for x in inv.hcas] == [("mlx5_0", ()), ("mlx5_1", (GONE,))]
    assert inv.fabrics[0].hcas == ("mlx5_0", "mlx5_1") and inv.fabrics[0].state is FabricState.DEGRADED
    assert usable_fabrics(inv)["ib"].hcas == ("mlx5_0",)
    assert sick_hcas(inv, ("mlx5_1",)) == [f"mlx5_1 ({GONE})"]
