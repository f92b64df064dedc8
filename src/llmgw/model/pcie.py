"""How two PCIe devices are linked, from their paths in the PCIe tree (pure): the tiers
`nvidia-smi topo -m` names. In model/ because the agent (discovery, the GPU->HCA map for an
engine's environment) and the server (describe) both read it off the same inventory."""

from __future__ import annotations

# nvidia-smi topo -m's legend, nearest first (the order placement prefers them in):
#   PIX  = Connection traversing at most a single PCIe bridge
#   PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
#   PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
#   NODE = Connection traversing PCIe as well as the interconnect between PCIe Host
#          Bridges within a NUMA node
#   SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes
#          (e.g., QPI/UPI)
KINDS = ("X", "PIX", "PXB", "PHB", "NODE", "SYS")
RANK = {k: i for i, k in enumerate(KINDS)}


def link_kind(
    a: tuple[str, ...], b: tuple[str, ...], numa_a: int | None, numa_b: int | None
) -> str:
    """How devices `a` and `b` (pci_path ancestries) are linked, as `nvidia-smi topo -m`
    names it: "X" (the same device), "PIX", "PXB", "PHB", "NODE", "SYS"; "" unknown.

    From the lowest common ancestor of the two paths:
    - it is a PCIe bridge and each device hangs at most two levels below it (a switch's
      upstream port, then one downstream port; or one port with both directly below,
      the functions of a multi-port card): PIX, the one switch NVML calls "single";
    - it is a bridge but a device is deeper (cascaded switches): PXB;
    - it is the host bridge itself (two root ports of one root complex): PHB;
    - there is none (two host bridges): NODE on one NUMA node, SYS across two, and
      unknown when either node is unknown (sysfs's -1) rather than a guess.
    """
    if not a or not b:
        return ""
    if a == b:
        return "X"
    common = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        common += 1
    if common >= 2:
        if common == len(a) or common == len(b):
            return "PIX"  # one is the other's bridge: nothing but that bridge between
        return "PIX" if len(a) - common <= 2 and len(b) - common <= 2 else "PXB"
    if common == 1:
        return "PHB"
    if numa_a is None or numa_b is None:
        return ""
    return "NODE" if numa_a == numa_b else "SYS"
