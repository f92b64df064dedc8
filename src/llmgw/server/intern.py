"""Equal parts of inventories, kept once.

Ten thousand nodes of one kind report the same GPU model, PCI addresses, HCA ports,
fabrics, model copies on a shared filer and engine availability; decoded, each node held
its own copy of every one of them, and each GPU its own copies of its NVLink peers' UUIDs.
`Interner.inventory` returns an equal Inventory whose hashable parts are shared between
nodes, and whose NVLink peer names are the peers' own `uuid` strings.

Bounded, as all state a peer can grow: past `limit` values the table starts again (what
was shared stays shared; later values are shared from then on).
"""

from __future__ import annotations

from typing import Any, TypeVar

from attrs import evolve

from llmgw.model.inventory import Gpu, Hca, Inventory

T = TypeVar("T")

LIMIT = 16_384


class Interner:
    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._seen: dict[Any, Any] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def __call__(self, value: T) -> T:
        """The value equal to `value` seen before, or `value` itself (then remembered)."""
        try:
            got = self._seen.get(value)
        except TypeError:  # unhashable: kept as it is
            return value
        if got is not None:
            return got
        if len(self._seen) >= self.limit:
            self._seen.clear()
        self._seen[value] = value
        return value

    def gpu(self, g: Gpu, uuids: dict[str, str]) -> Gpu:
        return evolve(
            g,
            name=self(g.name),
            pci_bus_id=self(g.pci_bus_id),
            compute_capability=self(g.compute_capability),
            nvlink_peers={uuids.get(p, p): n for p, n in g.nvlink_peers.items()},
        )

    def inventory(self, inv: Inventory) -> Inventory:
        uuids = {g.uuid: g.uuid for g in inv.gpus}
        return evolve(
            inv,
            gpus=tuple(self.gpu(g, uuids) for g in inv.gpus),
            hcas=tuple(Hca(self(h.name), h.node_guid, self(h.ports)) for h in inv.hcas),
            fabrics=self(inv.fabrics),
            unlabelled_hcas=self(inv.unlabelled_hcas),
            storage=self(inv.storage),
            warnings=self(inv.warnings),
            engines=self(inv.engines),
        )
