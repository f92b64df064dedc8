"""The bootstrap interface: derived from mgmt_addr or checked against the node."""

from __future__ import annotations

import socket
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.discovery.interfaces import (
    _fallback_pairs,
    interface_addresses,
    parse_addr_dump,
    parse_if_inet6,
    resolve_mgmt_interface,
)
from llmgw.errors import ConfigError

NODE = {
    "lo": ("127.0.0.1", "::1"),
    "eno1": ("192.168.1.20",),
    "ens1f0np0": ("10.0.0.5", "fd00::5", "fe80::5"),
    "ens1f1np1": (),
    "docker0": ("172.17.0.1",),
}


def test_empty_is_derived_from_mgmt_addr() -> None:
    assert resolve_mgmt_interface("", "10.0.0.5", NODE) == "ens1f0np0"
    assert resolve_mgmt_interface("", "192.168.1.20", NODE) == "eno1"
    assert resolve_mgmt_interface("", "fd00:0::5", NODE) == "ens1f0np0"  # any IPv6 spelling
    assert resolve_mgmt_interface("", "127.0.0.1", NODE) == "lo"  # llmgw dev on one machine


def test_nobody_holds_mgmt_addr() -> None:
    with pytest.raises(ConfigError) as e:
        resolve_mgmt_interface("", "10.0.0.11", NODE, source="/etc/llmgw/agent.yaml")
    msg = str(e.value)
    assert msg.startswith("/etc/llmgw/agent.yaml: mgmt_addr: 10.0.0.11 is held by no interface")
    assert "ens1f0np0 10.0.0.5 fd00::5 fe80::5" in msg and "ens1f1np1 (no address)" in msg
    assert e.value.key == "mgmt_addr"


def test_several_holders_first_by_name_and_never_loopback() -> None:
    both = {"lo": ("127.0.0.1", "10.0.0.5"), "br0": ("10.0.0.5",), "eth0": ("10.0.0.5",)}
    assert resolve_mgmt_interface("", "10.0.0.5", both) == "br0"
    assert resolve_mgmt_interface("", "10.0.0.5", {"lo": ("10.0.0.5",), "zz": ("10.0.0.5",)}) == "zz"


def test_link_local_scope_names_the_interface() -> None:
    two = {"eth0": ("fe80::1",), "eth1": ("fe80::1",)}
    assert resolve_mgmt_interface("", "fe80::1%eth1", two) == "eth1"


def test_configured_must_exist() -> None:
    with pytest.raises(ConfigError) as e:
        resolve_mgmt_interface("eth0", "10.0.0.5", NODE)
    assert "mgmt_interface: eth0: no such interface on this node (interfaces: docker0 172.17.0.1, eno1" in str(e.value)
    assert e.value.key == "mgmt_interface"


def test_configured_must_hold_mgmt_addr() -> None:
    with pytest.raises(ConfigError) as e:
        resolve_mgmt_interface("eno1", "10.0.0.5", NODE)
    assert "eno1 does not hold mgmt_addr 10.0.0.5 (it has 192.168.1.20)" in str(e.value)
    with pytest.raises(ConfigError, match=r"ens1f1np1 does not hold mgmt_addr 10.0.0.5 \(it has no address\)"):
        resolve_mgmt_interface("ens1f1np1", "10.0.0.5", NODE)
    assert resolve_mgmt_interface("ens1f0np0", "10.0.0.5", NODE) == "ens1f0np0"


def test_mgmt_addr_must_be_an_address() -> None:
    with pytest.raises(ConfigError, match="'node7.example' is not an IP address"):
        resolve_mgmt_interface("", "node7.example", NODE)


@given(st.text(max_size=20), st.text(max_size=40),
       st.dictionaries(st.text(max_size=8), st.lists(st.text(max_size=20), max_size=3).map(tuple), max_size=4))
def test_resolve_is_total(configured: str, addr: str, addrs: dict[str, tuple[str, ...]]) -> None:
    try:
        name = resolve_mgmt_interface(configured, addr, addrs)
    except ConfigError:
        return
    assert name in addrs


# --- readers ------------------------------------------------------------------------


def test_loopback_on_this_machine() -> None:
    addrs = interface_addresses()
    assert "127.0.0.1" in addrs["lo"]
    assert resolve_mgmt_interface("", "127.0.0.1", addrs) == "lo"
    # The ioctl + /proc reader sees the same primary addresses.
    assert ("lo", "127.0.0.1") in _fallback_pairs()


def _msg(kind: int, body: bytes) -> bytes:
    return struct.pack("=LHHLL", 16 + len(body), kind, 0, 1, 0) + body + b"\0" * (-len(body) % 4)


def _attr(kind: int, data: bytes) -> bytes:
    return struct.pack("=HH", 4 + len(data), kind) + data + b"\0" * (-len(data) % 4)


def _addr(family: int, index: int, *attrs: bytes) -> bytes:
    return _msg(20, struct.pack("=BBBBI", family, 24, 0, 0, index) + b"".join(attrs))


def test_netlink_dump_labels_local_and_v6() -> None:
    dump = (
        _addr(socket.AF_INET, 2, _attr(1, bytes([10, 0, 0, 1])), _attr(2, bytes([10, 0, 0, 5])),
              _attr(3, b"eth0\0"))
        + _addr(socket.AF_INET, 2, _attr(2, bytes([10, 0, 0, 6])), _attr(3, b"eth0:1\0"))
        + _addr(socket.AF_INET6, 2, _attr(1, bytes.fromhex("fd00" + "00" * 13 + "05")))
        + _addr(socket.AF_INET, 9, _attr(2, b"\1\2"))  # wrong length: skipped
        + _msg(3, b"\0\0\0\0")
    )
    pairs, done = parse_addr_dump(dump, {2: "eth0"})
    assert done
    # IFA_LOCAL over the point-to-point peer; an alias keeps its label, as getifaddrs
    # (and so NCCL and Gloo) name it.
    assert pairs == [("eth0", "10.0.0.5"), ("eth0:1", "10.0.0.6"), ("eth0", "fd00::5")]


@given(st.binary(max_size=300))
def test_netlink_parse_is_total(data: bytes) -> None:
    pairs, _ = parse_addr_dump(data, {1: "lo"})
    assert all(isinstance(n, str) and isinstance(a, str) for n, a in pairs)


def test_if_inet6() -> None:
    text = ("00000000000000000000000000000001 01 80 10 80       lo\n"
            "fe8000000000000000fc00fffe000001 04 40 20 80     eth0\nbad line\n")
    assert parse_if_inet6(text) == [("lo", "::1"), ("eth0", "fe80::fc:ff:fe00:1")]


@given(st.text(max_size=200))
def test_if_inet6_is_total(text: str) -> None:
    parse_if_inet6(text)
