"""The bootstrap interface NCCL and Gloo bind to: derived from mgmt_addr, or checked.

Without NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME, Gloo binds the address the hostname
resolves to (127.0.1.1 on Debian and Ubuntu) and a multi-node replica dies in "Gloo
connectFullMesh failed"; a configured name that this node lacks fails the same way, later.
So the agent settles the name at start: `resolve_mgmt_interface` (pure) over the
addresses `interface_addresses` reads.

Names are those getifaddrs(3) gives, which is what NCCL and Gloo match against: for IPv4
an address's label ("eth0", or "eth0:1" for an alias), for IPv6 the interface's name.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
from collections.abc import Iterable, Mapping

from llmgw.errors import ConfigError

log = logging.getLogger(__name__)

LOOPBACK = "lo"


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.split("%", 1)[0].strip())
    except ValueError:
        return None


def _listing(addrs: Mapping[str, tuple[str, ...]]) -> str:
    return ", ".join(f"{n} {' '.join(a) or '(no address)'}" for n, a in sorted(addrs.items())) or "none"


def resolve_mgmt_interface(
    configured: str,
    mgmt_addr: str,
    addrs: Mapping[str, tuple[str, ...]],
    *,
    source: str = "agent configuration",
) -> str:
    """The interface engines bootstrap on: `configured` once checked, else the one that
    holds `mgmt_addr`. `addrs`: interface name -> its IPv4/IPv6 addresses. `source`
    names the config file in the errors.

    ConfigError when mgmt_addr is not an IP address (a name cannot be matched to an
    interface), when no interface holds it, or when the configured one is absent or does
    not hold it: engines bound elsewhere than the address peers are told would hang.

    Several interfaces holding mgmt_addr (an address on a bridge and on its port, a
    service address also on `lo`): not loopback before loopback, then the first by name,
    so the choice is the same at every start and never `lo`, which no peer reaches.
    """
    want = _ip(mgmt_addr)
    if want is None:
        raise ConfigError(
            source, "mgmt_addr",
            f"{mgmt_addr!r} is not an IP address; give the address peers reach this node "
            "at, so that its interface can be found",
        )
    scope = mgmt_addr.split("%", 1)[1].strip() if "%" in mgmt_addr else ""
    holders = sorted(
        (n for n, a in addrs.items() if any(_ip(x) == want for x in a)),
        key=lambda n: (n == LOOPBACK, n),
    )
    if scope:  # fe80::1%eth0: a link-local address names its interface itself
        holders = [n for n in holders if n == scope]
    if configured:
        if configured not in addrs:
            raise ConfigError(
                source, "mgmt_interface",
                f"{configured}: no such interface on this node (interfaces: {_listing(addrs)})",
            )
        if configured not in holders:
            have = " ".join(addrs[configured]) or "no address"
            raise ConfigError(
                source, "mgmt_interface",
                f"{configured} does not hold mgmt_addr {mgmt_addr} (it has {have})",
            )
        return configured
    if not holders:
        raise ConfigError(
            source, "mgmt_addr",
            f"{mgmt_addr} is held by no interface on this node, so engines cannot "
            f"bootstrap on it (interfaces: {_listing(addrs)})",
        )
    return holders[0]


# --- reading the addresses: rtnetlink (every address, aliases and secondaries too) ---

_NLMSG = struct.Struct("=LHHLL")  # nlmsghdr: len, type, flags, seq, pid
_IFADDR = struct.Struct("=BBBBI")  # ifaddrmsg: family, prefixlen, flags, scope, index
_RTA = struct.Struct("=HH")  # rtattr: len, type
RTM_NEWADDR, RTM_GETADDR = 20, 22
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
IFA_ADDRESS, IFA_LOCAL, IFA_LABEL = 1, 2, 3


def _align(n: int) -> int:
    return (n + 3) & ~3


def parse_addr_dump(
    data: bytes, names: Mapping[int, str]
) -> tuple[list[tuple[str, str]], bool]:
    """(interface, address) pairs from RTM_NEWADDR messages, and whether NLMSG_DONE was
    seen. Truncated or malformed messages end the parse; nothing raises on garbage."""
    out: list[tuple[str, str]] = []
    off = 0
    while off + _NLMSG.size <= len(data):
        length, kind, _flags, _seq, _pid = _NLMSG.unpack_from(data, off)
        if length < _NLMSG.size or off + length > len(data):
            break
        if kind in (NLMSG_DONE, NLMSG_ERROR):
            return out, True
        body = data[off + _NLMSG.size : off + length]
        off += _align(length)
        if kind != RTM_NEWADDR or len(body) < _IFADDR.size:
            continue
        family, _plen, _fl, _scope, index = _IFADDR.unpack_from(body, 0)
        attrs: dict[int, bytes] = {}
        at = _IFADDR.size
        while at + _RTA.size <= len(body):
            alen, atype = _RTA.unpack_from(body, at)
            if alen < _RTA.size or at + alen > len(body):
                break
            attrs.setdefault(atype, body[at + _RTA.size : at + alen])
            at += _align(alen)
        # IPv4: IFA_LOCAL is this end (IFA_ADDRESS is the peer on point-to-point links).
        raw = attrs.get(IFA_LOCAL) or attrs.get(IFA_ADDRESS)
        if family == socket.AF_INET and raw and len(raw) == 4:
            addr = str(ipaddress.IPv4Address(raw))
        elif family == socket.AF_INET6 and raw and len(raw) == 16:
            addr = str(ipaddress.IPv6Address(raw))
        else:
            continue
        label = attrs.get(IFA_LABEL, b"").split(b"\0", 1)[0].decode("utf-8", "replace")
        name = label if family == socket.AF_INET and label else names.get(index, "")
        if name:
            out.append((name, addr))
    return out, False


def _netlink_pairs() -> list[tuple[str, str]]:
    names = dict(socket.if_nameindex())
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as s:
        s.settimeout(2.0)
        s.bind((0, 0))
        body = _IFADDR.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        s.send(_NLMSG.pack(_NLMSG.size + len(body), RTM_GETADDR, NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + body)
        pairs: list[tuple[str, str]] = []
        for _ in range(10_000):  # bounded: a dump ends with NLMSG_DONE
            chunk = s.recv(65536)
            if not chunk:
                break
            got, done = parse_addr_dump(chunk, names)
            pairs += got
            if done:
                break
        return pairs


def _fallback_pairs() -> list[tuple[str, str]]:
    """Without netlink: each interface's primary IPv4 address (SIOCGIFADDR) and the IPv6
    addresses of /proc/net/if_inet6. Secondary IPv4 addresses are not seen this way."""
    import fcntl

    pairs: list[tuple[str, str]] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _index, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                res = fcntl.ioctl(s.fileno(), 0x8915, req)  # SIOCGIFADDR
            except OSError:
                continue  # no IPv4 address on it
            pairs.append((name, socket.inet_ntoa(res[20:24])))
    try:
        with open("/proc/net/if_inet6") as f:
            pairs += parse_if_inet6(f.read())
    except OSError as exc:
        log.debug("no /proc/net/if_inet6: %s", exc)
    return pairs


def parse_if_inet6(text: str) -> list[tuple[str, str]]:
    """/proc/net/if_inet6 lines ("00000000000000000000000000000001 01 80 10 80 lo")."""
    out = []
    for line in text.splitlines():
        f = line.split()
        if len(f) == 6 and len(f[0]) == 32:
            try:
                out.append((f[5], str(ipaddress.IPv6Address(bytes.fromhex(f[0])))))
            except ValueError:
                continue
    return out


def _group(pairs: Iterable[tuple[str, str]], names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {n: [] for n in names}
    for name, addr in pairs:
        if addr not in out.setdefault(name, []):
            out[name].append(addr)
    return {n: tuple(a) for n, a in sorted(out.items())}


def interface_addresses() -> dict[str, tuple[str, ...]]:
    """Every interface of this node with its IPv4 and IPv6 addresses (interfaces with
    none are listed too, so an error can say they exist). Blocking but quick."""
    names = [n for _i, n in socket.if_nameindex()]
    try:
        pairs = _netlink_pairs()
    except OSError as exc:
        log.warning("rtnetlink address dump failed (%s); reading ioctl and /proc", exc)
        pairs = _fallback_pairs()
    return _group(pairs, names)
