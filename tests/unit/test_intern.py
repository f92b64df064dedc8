"""Inventories' equal parts kept once: the same values, shared objects, a bounded table."""

from __future__ import annotations

from attrs import evolve

from fakes.cluster import node
from llmgw.model.inventory import Hca, IbPort, Inventory
from llmgw.server.peers.intern import MAX_WEIGHT, Interner
from llmgw.transport import codec
from llmgw.transport.messages import InventoryChanged


def inventory(name: str) -> Inventory:
    inv = node(name, 8, fabrics=["ib-1"], holds=["org/m"]).inventory
    port = IbPort(1, "ACTIVE", "LinkUp", 400.0, "InfiniBand", "fe80:0000:0000:0000")
    inv = evolve(inv, hcas=tuple(Hca(f"mlx5_{i}", f"{name}-{i}", (port,)) for i in range(4)))
    # As the server has it: decoded from the wire, every string its own object.
    msg = codec.decode(codec.encode(InventoryChanged(inv)))
    assert isinstance(msg, InventoryChanged)
    return msg.inventory


def test_interned_inventory_is_equal_and_shares_parts() -> None:
    interner = Interner()
    a, b = inventory("n1"), inventory("n2")
    ia, ib = interner.inventory(a), interner.inventory(b)
    assert ia == a and ib == b
    assert ia.gpus[0].name is ib.gpus[0].name
    assert ia.gpus[3].pci_bus_id is ib.gpus[3].pci_bus_id
    assert ia.hcas[0].ports is ib.hcas[0].ports
    # Containers whose length the node decides are shared element by element.
    assert ia.fabrics[0] is ib.fabrics[0]
    assert ia.storage.models and ia.storage.models[0] is ib.storage.models[0]
    # Said again, an inventory keeps the objects it already has.
    again = interner.inventory(ia)
    assert again.fabrics is ia.fabrics and again.storage.models is ia.storage.models
    # NVLink peers are named by the peers' own uuid strings, not copies of them.
    uuids = {id(g.uuid) for g in ia.gpus}
    assert all(id(p) in uuids for g in ia.gpus for p in g.nvlink_peers)


def test_the_table_is_bounded() -> None:
    interner = Interner(limit=10)
    for i in range(100):
        assert interner(f"value-{i}") == f"value-{i}"
        assert len(interner) <= 10
    assert interner({"unhashable": 1}) == {"unhashable": 1}


def test_heavy_values_are_not_kept() -> None:
    """A node that keeps sending new, large values cannot fill the table with them: a
    value past MAX_WEIGHT is returned as it is and not remembered."""
    interner = Interner(limit=10)
    for i in range(100):
        big = (f"{i}-" + "x" * MAX_WEIGHT,)
        assert interner(big) is big
    assert len(interner) == 0
    small = ("a", "b")
    assert interner(small) is small and len(interner) == 1
    heavy_copy = evolve(inventory("n1").storage.models[0], path="/m/" + "p" * MAX_WEIGHT)
    assert interner(heavy_copy) is heavy_copy and len(interner) == 1
