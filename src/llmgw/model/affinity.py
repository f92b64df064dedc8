"""Which HCA each GPU should use: the nearest of its fabric's HCAs in the PCIe tree (pure).

A GPU's RDMA traffic (NCCL's IB transport, UCX/NIXL's KV transfers) should leave through
the HCA under its own PCIe switch: an HCA across the host bridge or the CPU interconnect
halves GPUDirect RDMA's rate or turns it off (NCCL only uses GDR up to PXB by default,
NCCL_NET_GDR_LEVEL). The tiers are `nvidia-smi topo -m`'s, nearest first: one PCIe
switch (PIX), cascaded switches (PXB), one host bridge (PHB), one NUMA node (NODE), any
(SYS, or unknown). Ties are spread: two GPUs under one switch with two HCAs get one each.

Both the agent (for the engine's environment) and the server (for `describe replica`)
compute it from the same inventory, so it lives in model/, beside model/pcie.py's
link_kind, which it reads the tiers with.
An HCA with no active port ranks behind every active one: while a port is down its GPUs
use the next nearest, and the placement avoids it where it can.
"""

from __future__ import annotations

from collections.abc import Sequence

from attrs import frozen

from llmgw.model.inventory import Gpu, Hca
from llmgw.model.pcie import link_kind

TIERS = ("PIX", "PXB", "PHB", "NODE", "SYS", "")  # nearest first; "" unknown


@frozen
class GpuHca:
    """One GPU's HCA: its UUID and NVML index, the HCA's name, port and PCI address, and
    how the two are linked ("PIX" ... "SYS", "" when the tree does not say)."""

    gpu: str
    index: int
    hca: str
    port: int = 1
    link: str = ""
    gpu_bus_id: str = ""  # as the inventory has it ("00000000:18:00.0")
    hca_bus_id: str = ""  # sysfs name of the HCA's PCI function ("0000:1a:00.0"); "" unknown

    def line(self) -> str:
        """`GPU 0 -> mlx5_0 (PIX)`, for logs and `describe replica`."""
        return f"GPU {self.index} -> {self.hca} ({self.link or 'unknown'})"


def link(a: tuple[str, ...], b: tuple[str, ...], numa_a: int | None, numa_b: int | None) -> str:
    """How two devices are linked, from their PCIe ancestries (host bridge first) and NUMA
    nodes: model/pcie.py's link_kind, except that a pair whose paths are unknown but whose
    NUMA nodes are known is still NODE or SYS, and one path for both counts as PIX."""
    if a and b:
        kind = link_kind(a, b, numa_a, numa_b)
        return "PIX" if kind == "X" else kind
    if numa_a is None or numa_b is None:
        return ""
    return "NODE" if numa_a == numa_b else "SYS"


def _active_port(h: Hca) -> int:
    """The first active port's number; 0: none active."""
    return next((p.number for p in h.ports if p.active), 0)


def nearest_hcas(gpus: Sequence[Gpu], hcas: Sequence[Hca], allowed: Sequence[str]) -> tuple[GpuHca, ...]:
    """Each of `gpus` (in that order) with its nearest HCA among `allowed` (the fabric's
    HCAs on this node). HCAs named in `allowed` but absent from `hcas` are skipped; none
    left: (). Among equally near HCAs the one fewest GPUs took so far wins, then the name.
    """
    by_name = {h.name: h for h in hcas}
    pool = [by_name[n] for n in dict.fromkeys(allowed) if n in by_name]
    if not pool:
        return ()
    load = {h.name: 0 for h in pool}
    out = []
    for g in gpus:
        def key(h: Hca, g: Gpu = g) -> tuple[int, int, int, str]:
            kind = link(g.pci_path, h.pci_path, g.numa_node, h.numa_node)
            return (0 if _active_port(h) else 1, TIERS.index(kind), load[h.name], h.name)

        best = min(pool, key=key)
        load[best.name] += 1
        out.append(GpuHca(
            gpu=g.uuid,
            index=g.index,
            hca=best.name,
            port=_active_port(best) or (best.ports[0].number if best.ports else 1),
            link=link(g.pci_path, best.pci_path, g.numa_node, best.numa_node),
            gpu_bus_id=g.pci_bus_id,
            hca_bus_id=best.pci_path[-1] if best.pci_path else "",
        ))
    return tuple(out)


def for_member(gpus: Sequence[Gpu], hcas: Sequence[Hca], placed: Sequence[str],
               allowed: Sequence[str]) -> tuple[GpuHca, ...]:
    """nearest_hcas for the placed GPU UUIDs, in the order placed; a UUID this node does
    not list is left out (the start refuses it elsewhere)."""
    by_uuid = {g.uuid: g for g in gpus}
    return nearest_hcas([by_uuid[u] for u in placed if u in by_uuid], hcas, allowed)
