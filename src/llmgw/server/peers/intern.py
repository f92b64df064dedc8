"""Equal parts of inventories, kept once.

Ten thousand nodes of one kind report the same GPU model, PCI addresses, HCA ports,
fabrics, model copies on a shared filer and engine availability; decoded, each node held
its own copy of every one of them, and each GPU its own copies of its NVLink peers' UUIDs.
`Interner.inventory` returns an equal Inventory whose hashable parts are shared between
nodes, and whose NVLink peer names are the peers' own `uuid` strings.

Bounded, as all state a peer can grow, in count and in size: past `limit` values the
table starts again (what was shared stays shared; later values are shared from then on),
and a value heavier than MAX_WEIGHT (roughly its bytes) is kept as it is, never in the
table, so a node sending ever new inventories of large values holds the table to about
limit × MAX_WEIGHT. Containers a node's size decides (its models, warnings, fabrics,
engines) are interned element by element: a shared filer's model copies are equal on
every node that mounts it, the node's list of them is its own.
"""

from __future__ import annotations

from typing import Any, TypeVar

from attrs import evolve

from llmgw.model.inventory import Gpu, Inventory

T = TypeVar("T")

LIMIT = 16_384
MAX_WEIGHT = 1024  # about the bytes of one value worth sharing; heavier ones are not kept


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
        if _weight(value, MAX_WEIGHT) > MAX_WEIGHT:
            return value  # rare and large: sharing it would let a peer fill the table
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
            pci_path=self(g.pci_path),
            nvlink_peers={uuids.get(p, p): n for p, n in g.nvlink_peers.items()},
        )

    def inventory(self, inv: Inventory) -> Inventory:
        uuids = {g.uuid: g.uuid for g in inv.gpus}
        return evolve(
            inv,
            gpus=tuple(self.gpu(g, uuids) for g in inv.gpus),
            hcas=tuple(evolve(h, name=self(h.name), ports=self(h.ports), pci_path=self(h.pci_path))
                       for h in inv.hcas),
            fabrics=self.each(inv.fabrics),
            unlabelled_hcas=self.each(inv.unlabelled_hcas),
            storage=evolve(inv.storage, models=self.each(inv.storage.models)),
            warnings=self.each(inv.warnings),
            engines=self.each(inv.engines),
        )

    def each(self, values: tuple[T, ...]) -> tuple[T, ...]:
        """The tuple kept as it came when all its elements are shared already (the usual
        Hello again), else a new tuple of the shared elements."""
        out = tuple(self(v) for v in values)
        return values if all(a is b for a, b in zip(out, values, strict=True)) else out


def _weight(value: object, budget: int) -> int:
    """About the bytes `value` holds, counted until past `budget` (then any number above
    it): strings and bytes by length, tuples and attrs instances by their parts, anything
    else 8. The inventory's types nest a fixed few levels deep."""
    if isinstance(value, str | bytes):
        return len(value)
    if isinstance(value, tuple):
        parts: Any = value
    elif hasattr(type(value), "__attrs_attrs__"):
        parts = (getattr(value, a.name) for a in type(value).__attrs_attrs__)  # type: ignore[attr-defined]
    elif isinstance(value, dict):
        parts = (x for kv in value.items() for x in kv)
    else:
        return 8
    total = 8
    for part in parts:
        total += _weight(part, budget - total)
        if total > budget:
            break
    return total
