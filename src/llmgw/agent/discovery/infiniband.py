"""InfiniBand/RoCE HCAs from a sysfs tree, and fabric states from the configured labels.

Fabric labels come only from config: OpenSM's default subnet prefix is fe80:: on every
fabric, so nothing seen here can tell two fabrics apart.
"""

from __future__ import annotations

import logging
import os
import re

from attrs import frozen

from llmgw.agent.discovery.pcie import link_path, read_numa
from llmgw.config.agent import FabricConfig
from llmgw.errors import DiscoveryError
from llmgw.model.inventory import FabricReport, FabricState, Hca, IbPort

log = logging.getLogger(__name__)

_RATE = re.compile(r"^\s*([0-9.]+)\s*Gb/sec")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        log.debug("cannot read %s: %s", path, exc)
        return ""


def parse_state(text: str) -> str:
    """`4: ACTIVE` -> `ACTIVE`; `5: LinkUp` -> `LinkUp`; empty stays empty."""
    return text.split(":", 1)[1].strip() if ":" in text else text.strip()


def parse_rate(text: str) -> float:
    """`200 Gb/sec (4X HDR)` -> 200.0; unreadable -> 0.0."""
    m = _RATE.match(text)
    return float(m[1]) if m else 0.0


def subnet_prefix(gid: str) -> str:
    """First 64 bits of a GID: `fe80:0000:0000:0000:0c42:...` -> `fe80:0000:0000:0000`."""
    groups = gid.strip().split(":")
    return ":".join(groups[:4]) if len(groups) == 8 else ""


def read_port(port_dir: str, number: int) -> IbPort:
    return IbPort(
        number=number,
        state=parse_state(_read(os.path.join(port_dir, "state"))),
        phys_state=parse_state(_read(os.path.join(port_dir, "phys_state"))),
        rate_gbps=parse_rate(_read(os.path.join(port_dir, "rate"))),
        link_layer=_read(os.path.join(port_dir, "link_layer")),
        subnet_prefix=subnet_prefix(_read(os.path.join(port_dir, "gids", "0"))),
    )


def read_hcas(root: str) -> tuple[Hca, ...]:
    """Every HCA under `root` (e.g. /sys/class/infiniband), sorted by name. No root: none."""
    try:
        names = sorted(os.listdir(root))
    except OSError as exc:
        log.debug("no InfiniBand tree at %s: %s", root, exc)
        return ()
    hcas = []
    for name in names:
        ports_dir = os.path.join(root, name, "ports")
        try:
            port_names = os.listdir(ports_dir)
        except OSError:
            port_names = []
        ports = tuple(
            read_port(os.path.join(ports_dir, p), int(p))
            for p in sorted(port_names, key=lambda p: int(p) if p.isdigit() else -1)
            if p.isdigit()
        )
        guid = _read(os.path.join(root, name, "node_guid"))
        # `device` links to the HCA's PCI function: its place in the PCIe tree and its
        # NUMA node, which pair it with the GPUs under the same switch. No link (a soft
        # RoCE device, an older tree): unknown, not an error.
        device = os.path.join(root, name, "device")
        pci = link_path(device)
        numa = read_numa(os.path.join(device, "numa_node")) if pci else None
        hcas.append(Hca(name=name, node_guid=guid, ports=ports, pci_path=pci, numa_node=numa))
    return tuple(hcas)


@frozen
class FabricAssessment:
    fabrics: tuple[FabricReport, ...] = ()
    unlabelled_hcas: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def fabric_state(ports: list[IbPort]) -> FabricState:
    active = sum(1 for p in ports if p.active)
    if ports and active == len(ports):
        return FabricState.UP
    return FabricState.DEGRADED if active else FabricState.DOWN


def assess_fabrics(
    hcas: tuple[Hca, ...], fabrics: tuple[FabricConfig, ...], *, source: str = ""
) -> FabricAssessment:
    """Fabric states from the configured labels. A labelled HCA that is absent: error."""
    by_name = {h.name: h for h in hcas}
    where = f"{source}: " if source else ""
    reports = []
    warnings = []
    for fab in fabrics:
        for hca in fab.hcas:
            if hca not in by_name:
                have = ", ".join(sorted(by_name)) or "none"
                raise DiscoveryError(
                    f"{where}fabric {fab.name!r} names HCA {hca!r}, which this node does "
                    f"not have (HCAs here: {have}); a wrong label hangs a replica on its "
                    "first all-reduce"
                )
        ports = [p for hca in fab.hcas for p in by_name[hca].ports]
        state = fabric_state(ports)
        if state is not FabricState.UP:
            down = [f"{h}/{p.number}" for h in fab.hcas for p in by_name[h].ports if not p.active]
            warnings.append(f"fabric {fab.name} is {state}: ports not active: {', '.join(down)}")
        if fab.rate_gbps:
            for hca in fab.hcas:
                for p in by_name[hca].ports:
                    if p.active and p.rate_gbps != fab.rate_gbps:
                        warnings.append(
                            f"fabric {fab.name}: {hca} port {p.number} runs at "
                            f"{p.rate_gbps:g} Gb/s, configured rate_gbps is {fab.rate_gbps:g}"
                        )
        reports.append(
            FabricReport(name=fab.name, hcas=tuple(fab.hcas), state=state, rate_gbps=fab.rate_gbps)
        )
    labelled = {h for fab in fabrics for h in fab.hcas}
    unlabelled = tuple(h.name for h in hcas if h.name not in labelled)
    return FabricAssessment(tuple(reports), unlabelled, tuple(warnings))
