"""The /proc socket parsers (agent/discovery/procnet.py), on text shaped like the kernel's."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.discovery.procnet import (
    Listener,
    PortConflict,
    answering,
    command_line,
    parse_tcp_table,
    session_of_stat,
    socket_inode,
)

# /proc/net/tcp on a little-endian host: 127.0.0.1:20001 LISTEN (inode 41234),
# 0.0.0.0:22 LISTEN, an established connection, and 10.1.2.3:8000 LISTEN.
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:4E21 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 41234 1 0000000000000000 100 0 0 10 0
   1: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1111 1 0000000000000000 100 0 0 10 0
   2: 0100007F:4E21 0100007F:B0A2 01 00000000:00000000 00:00000000 00000000  1000        0 41299 1 0000000000000000 20 4 30 10 -1
   3: 0302010A:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 5555 1 0000000000000000 100 0 0 10 0
"""

# /proc/net/tcp6: [::]:20002 LISTEN (inode 777), [::1]:20003 LISTEN (inode 778),
# [::ffff:127.0.0.1]:20004 LISTEN (inode 779), and one in TIME_WAIT.
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:4E22 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 777 1 0000000000000000 100 0 0 10 0
   1: 00000000000000000000000001000000:4E23 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 778 1 0000000000000000 100 0 0 10 0
   2: 0000000000000000FFFF00000100007F:4E24 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 779 1 0000000000000000 100 0 0 10 0
   3: 00000000000000000000000001000000:4E23 00000000000000000000000001000000:C350 06 00000000:00000000 03:00000F5B 00000000     0        0 0 3 0000000000000000
"""


def test_ipv4_listeners_only() -> None:
    assert parse_tcp_table(TCP) == (
        Listener("127.0.0.1", 20001, 41234),
        Listener("0.0.0.0", 22, 1111),
        Listener("10.1.2.3", 8000, 5555),
    )


def test_ipv6_listeners() -> None:
    assert parse_tcp_table(TCP6) == (
        Listener("::", 20002, 777),
        Listener("::1", 20003, 778),
        Listener("::ffff:7f00:1", 20004, 779),
    )


def test_big_endian_host() -> None:
    line = ("   0: 7F000001:4E21 00000000:0000 0A 00000000:00000000 00:00000000 00000000"
            "  1000        0 9 1 0000000000000000 100 0 0 10 0")
    assert parse_tcp_table(line, byteorder="big") == (Listener("127.0.0.1", 20001, 9),)


def test_answering_prefers_exact_address_then_wildcard() -> None:
    table = (
        *parse_tcp_table(TCP), *parse_tcp_table(TCP6),
        Listener("0.0.0.0", 20001, 42),  # a wildcard beside the exact one (SO_REUSEPORT)
    )
    assert answering(table, "127.0.0.1", 20001) == {41234}
    assert answering(table, "10.9.9.9", 20001) == {42}
    assert answering(table, "127.0.0.1", 20002) == {777}  # "::" takes IPv4 too
    assert answering(table, "::1", 20003) == {778}
    assert answering(table, "127.0.0.1", 20003) == frozenset()
    assert answering(table, "127.0.0.1", 20004) == {779}  # v4-mapped
    assert answering(table, "127.0.0.1", 20099) == frozenset()
    assert answering(table, "node-7.example", 20001) == {41234, 42}  # a name: all on the port


def test_session_of_stat() -> None:
    # A command name with spaces and a ')' in it.
    stat = "4242 (python3 (x) y) S 1 4242 4242 0 -1 4194560 1603 0 0 0 12 3 0 0 20 0 3 0 98765 0 0"
    assert session_of_stat(stat) == 4242
    assert session_of_stat("17 (sh) S 1 17 99 0 -1") == 99
    assert session_of_stat("17 (sh) Z 1 17 99 0 -1") is None
    assert session_of_stat("garbage") is None
    assert session_of_stat("17 (sh) S 1") is None


def test_socket_links() -> None:
    assert socket_inode("socket:[41234]") == 41234
    assert socket_inode("pipe:[41234]") is None
    assert socket_inode("/dev/null") is None
    assert socket_inode("socket:[]") is None


def test_command_line_and_reason() -> None:
    raw = b"/usr/bin/python3\0-m\0llmgw.simengine\0serve\0org/m\0"
    assert command_line(raw) == "/usr/bin/python3 -m llmgw.simengine serve org/m"
    assert command_line(b"x" * 500, limit=10) == "x" * 9 + "…"
    c = PortConflict(20001, ((1234, "python -m http.server"),))
    assert c.reason == "port 20001 is in use by pid 1234 (python -m http.server)"
    assert "not visible" in PortConflict(20001).reason
    many = PortConflict(1, tuple((p, "") for p in range(5)))
    assert many.reason == "port 1 is in use by pid 0, pid 1, pid 2 and 2 more"


hexchars = st.text(alphabet="0123456789ABCDEFabcdefXZ: ", max_size=60)
lines = st.lists(
    st.one_of(
        st.text(max_size=120),
        st.builds(lambda a, p, s, i: f"  0: {a}:{p} 00000000:0000 {s} 0:0 0:0 0 1 0 {i} 1",
                  hexchars, hexchars, st.sampled_from(["0A", "01", "zz"]), st.text(max_size=8)),
    ),
    max_size=8,
)


@given(lines, st.sampled_from(["little", "big"]))
def test_tcp_parser_is_total(ls: list[str], order: str) -> None:
    for s in parse_tcp_table("\n".join(ls), byteorder=order):
        assert 0 <= s.port <= 0xFFFF and s.inode > 0
        answering((s,), s.addr, s.port)


@given(st.text(max_size=200))
def test_stat_and_link_parsers_are_total(text: str) -> None:
    got = session_of_stat(text)
    assert got is None or isinstance(got, int)
    assert socket_inode(text) is None or text.startswith("socket:[")


@given(st.binary(max_size=300))
def test_cmdline_is_total(raw: bytes) -> None:
    assert len(command_line(raw)) <= 200
