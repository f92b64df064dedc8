"""The monitor's events folded into what the operator is told (transport/handshake.py).
The event sequences are those libzmq 4.3 reported on this machine for each case; the
same cases against a real server are in tests/integration/test_cli_live.py."""

from __future__ import annotations

import zmq

from llmgw.errors import HandshakeError, RefusedError
from llmgw.transport.client import check_address
from llmgw.transport.handshake import HandshakeLog

ADDR = "tcp://127.0.0.1:7443"


def _fold(*events: tuple[int, int]) -> HandshakeLog:
    hlog = HandshakeLog(ADDR, "/etc/llmgw/server.key")
    for event, value in events:
        hlog.feed(event, value)
    return hlog


DEAD = [(zmq.EVENT_CONNECT_DELAYED, 0), (zmq.EVENT_CLOSED, 12), (zmq.EVENT_CONNECT_RETRIED, 200)]
DROPPED = [(zmq.EVENT_CONNECTED, 12), (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32),
           (zmq.EVENT_DISCONNECTED, 12), (zmq.EVENT_CONNECT_RETRIED, 200)]


def test_dead_server_is_silence_with_no_tcp_connection() -> None:
    hlog = _fold(*DEAD, *DEAD)
    assert hlog.verdict() is None
    assert hlog.silence(5) == (f"nothing answers at {ADDR}: no TCP connection within 5s, refused 2 "
                               "times (is `llmgw server` running there?)")


def test_nothing_listens_after_three_refused_connects_and_no_connection() -> None:
    assert not _fold(*DEAD, *DEAD).nothing_listens()
    assert _fold(*DEAD, *DEAD, *DEAD).nothing_listens()
    # A listener that took one connection is not "nothing": wait out the Hello's bound.
    assert not _fold(*DEAD, *DROPPED, *DEAD, *DEAD).nothing_listens()


def test_refused_key_is_final_at_once() -> None:
    found = _fold((zmq.EVENT_CONNECTED, 12), (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)).verdict()
    assert isinstance(found, RefusedError) and found.exit_code == 3
    assert "refused this key" in str(found) and "ZAP status 400" in str(found)


def test_wrong_server_key_after_two_dropped_handshakes() -> None:
    assert _fold(*DROPPED).verdict() is None  # one drop: a server restarting mid-handshake
    found = _fold(*DROPPED, *DROPPED).verdict()
    assert isinstance(found, HandshakeError) and found.exit_code == 3
    assert str(found) == (f"no CURVE handshake with {ADDR}: the server dropped the connection in "
                          "the handshake; wrong server_key (/etc/llmgw/server.key), or not an "
                          "llmgw server")


def test_a_success_between_drops_is_no_wrong_key() -> None:
    hlog = _fold(*DROPPED, (zmq.EVENT_CONNECTED, 12), (zmq.EVENT_HANDSHAKE_SUCCEEDED, 0), *DROPPED)
    assert hlog.verdict() is None
    assert "took this key but did not answer" in hlog.silence(5)


def test_zeromq_without_curve_and_a_tcp_listener() -> None:
    found = _fold((zmq.EVENT_CONNECTED, 12), (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                                              zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)).verdict()
    assert isinstance(found, HandshakeError) and "without CURVE" in str(found)
    hlog = _fold((zmq.EVENT_CONNECTED, 12))
    assert hlog.verdict() is None and "no CURVE handshake came within 5s" in hlog.silence(5)


def test_check_address() -> None:
    for good in ("tcp://127.0.0.1:7443", "tcp://llmgw-server.internal:7443", "tcp://[::1]:1"):
        assert check_address(good) is None
    assert "not HTTP" in (check_address("http://127.0.0.1:7443") or "")
    for bad in ("127.0.0.1:7443", "tcp://h", "tcp://h:0", "tcp://h:70000", "ipc:///x", ""):
        assert "tcp://HOST:PORT" in (check_address(bad) or ""), bad
