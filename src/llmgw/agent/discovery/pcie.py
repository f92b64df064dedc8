"""PCIe ancestry of GPUs and HCAs from sysfs.

Linux lays the PCIe tree out as directories: /sys/bus/pci/devices/<dddd:bb:dd.f> is a
symlink to /sys/devices/pci<dddd:bb>/<root port>/<switch upstream>/<switch downstream>/
<device>, so the resolved path read from the host bridge down is the device's ancestry.
That is all `nvidia-smi topo -m` needs to tell a same-switch pair (PIX) from one across
the CPU (PHB), so placement can prefer the former on nodes without NVLink.

`parse_pci_path` is pure (how two paths are linked is model/pcie.py's `link_kind`);
`pci_path`, `link_path` and `numa_node` are the thin readers around them. None of them
raises: what cannot be read is unknown.
"""

from __future__ import annotations

import logging
import os
import re

log = logging.getLogger(__name__)

SYS_ROOT = "/sys"

# "pci0000:17"; domains past 0xffff exist (Intel VMD puts its own at 10000).
_HOST_BRIDGE = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")
# "0000:17:01.0": domain, bus, device (0-1f) and function (0-7), as sysfs names them.
_DEVICE = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[01][0-9a-f]\.[0-7]$")
# What NVML and nvidia-smi print: "00000000:18:00.0", upper or lower case.
_BUS_ID = re.compile(r"^([0-9a-fA-F]{1,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")



def sysfs_name(bus_id: str) -> str:
    """`00000000:18:00.0` (NVML) -> `0000:18:00.0` (sysfs); "" when it is not a bus id."""
    m = _BUS_ID.match(bus_id.strip()) if isinstance(bus_id, str) else None
    if m is None:
        return ""
    domain, bus, dev, fn = m.groups()
    if int(dev, 16) > 0x1F:
        return ""
    return f"{int(domain, 16):04x}:{bus.lower()}:{dev.lower()}.{fn}"


def parse_pci_path(resolved: str) -> tuple[str, ...]:
    """The ancestry in a resolved sysfs path, host bridge first, the device last.

    `/sys/devices/pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:00.0/0000:1a:00.0`
    -> ("pci0000:17", "0000:17:01.0", "0000:18:00.0", "0000:19:00.0", "0000:1a:00.0").
    Components after the last PCI device (a device's own subdirectories) are dropped;
    a path with no host bridge, or with no device below it, is unknown: ().
    """
    if not isinstance(resolved, str):
        return ()
    parts = resolved.split("/")
    for i, part in enumerate(parts):
        if _HOST_BRIDGE.match(part):
            chain = [part]
            for p in parts[i + 1 :]:
                if not _DEVICE.match(p):
                    break
                chain.append(p)
            return tuple(chain) if len(chain) > 1 else ()
    return ()


def link_path(link: str) -> tuple[str, ...]:
    """The ancestry of the PCI device a symlink points at (e.g. an HCA's `device`)."""
    try:
        resolved = os.path.realpath(link, strict=True)
    except (OSError, ValueError) as exc:
        log.debug("no PCI device behind %s: %s", link, exc)
        return ()
    return parse_pci_path(resolved)


def pci_path(bus_id: str, sys_root: str = SYS_ROOT) -> tuple[str, ...]:
    """The PCIe ancestry of the device `bus_id` (NVML's or sysfs's form); () if unknown.

    The path must end at the device asked for: a link that resolves somewhere else (a
    broken or hand-made tree) is not taken for it.
    """
    name = sysfs_name(bus_id)
    if not name:
        return ()
    path = link_path(os.path.join(sys_root, "bus", "pci", "devices", name))
    return path if path and path[-1] == name else ()


def numa_node(bus_id: str, sys_root: str = SYS_ROOT) -> int | None:
    """The device's NUMA node from sysfs; None when unknown (-1, absent, unreadable)."""
    name = sysfs_name(bus_id)
    if not name:
        return None
    return read_numa(os.path.join(sys_root, "bus", "pci", "devices", name, "numa_node"))


def read_numa(path: str) -> int | None:
    """A sysfs `numa_node` file: "1\\n" -> 1; "-1" (no NUMA information) -> None."""
    try:
        with open(path) as f:
            node = int(f.read(64).strip())
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        log.debug("no NUMA node in %s: %s", path, exc)
        return None
    return node if node >= 0 else None
