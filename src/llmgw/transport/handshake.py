"""What a DEALER's socket monitor says about why the server does not answer.

A DEALER hides the connection: a dead server, a server that turns our key away, and a
server whose key is not the one we hold all look like silence. libzmq's socket monitor
tells them apart (libzmq 4.3, measured on this machine):

- nothing listens: CONNECT_DELAYED, CLOSED, CONNECT_RETRIED, over and over, never
  CONNECTED;
- our key refused by the server's ZAP handler: CONNECTED, HANDSHAKE_FAILED_AUTH with the
  ZAP status code (400), DISCONNECTED;
- a server_key that is not the server's: the server cannot open our CURVE HELLO and
  drops the connection, which the client sees as CONNECTED, HANDSHAKE_FAILED_NO_DETAIL
  (EPIPE or ECONNRESET), DISCONNECTED, on every retry;
- a ZeroMQ peer without CURVE: HANDSHAKE_FAILED_PROTOCOL (ZMTP_MECHANISM_MISMATCH);
- a TCP listener that is not ZeroMQ at all: CONNECTED, then nothing.

`HandshakeLog` folds the events (data in, verdict out: no socket, no clock); `Monitor`
is the thin shell that reads them from the monitor socket.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio
import zmq
from attrs import define
from zmq.utils.monitor import parse_monitor_message

from llmgw.errors import HandshakeError, LlmgwError, RefusedError
from llmgw.transport.zmqtrio import TrioSocket

log = logging.getLogger(__name__)

EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED
          | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
          | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
          | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)

# A server restarting mid-handshake drops one connection; a wrong server_key drops every
# one. Two in a row, with no success between, is the key.
DROPS_BEFORE_VERDICT = 2
# libzmq retries a refused connect every RECONNECT_IVL (200 ms for llmgw's DEALERs): three
# refusals is well under a second, and a listener that is merely slow still accepts.
UNREACHABLE_RETRIES = 3


@define
class HandshakeLog:
    """The connection attempts to one address, as the monitor reported them."""

    address: str
    server_key_file: str = ""
    connects: int = 0  # TCP connections made
    retries: int = 0  # TCP connects that failed and will be retried
    succeeded: bool = False  # a CURVE handshake completed (the server knows our key)
    auth_status: int = 0  # the ZAP status code of a refused handshake
    protocol_error: int = 0  # the ZMTP protocol error of a failed handshake
    drops: int = 0  # connections dropped during the handshake since the last success

    def feed(self, event: int, value: int) -> None:
        if event == zmq.EVENT_CONNECTED:
            self.connects += 1
        elif event == zmq.EVENT_CONNECT_RETRIED:
            self.retries += 1
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.succeeded, self.drops = True, 0
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self.auth_status = value
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self.protocol_error = value
        elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self.drops += 1

    def verdict(self) -> LlmgwError | None:
        """The error that waiting longer will not change, if there is one yet."""
        if self.auth_status:
            return RefusedError(
                f"the server at {self.address} refused this key in the CURVE handshake "
                f"(ZAP status {self.auth_status}): it is not among the server's authorized "
                "keys (never issued there with `llmgw keys issue`, or revoked)")
        if self.protocol_error == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return HandshakeError(f"{self.address} speaks ZeroMQ without CURVE: not an llmgw server")
        if self.protocol_error:
            return HandshakeError(self._wrong_key(f"ZMTP protocol error {self.protocol_error:#x}"))
        if self.drops >= DROPS_BEFORE_VERDICT and not self.succeeded:
            return HandshakeError(self._wrong_key("the server dropped the connection in the "
                                                  "handshake"))
        return None

    def _wrong_key(self, what: str) -> str:
        key = f" ({self.server_key_file})" if self.server_key_file else ""
        return (f"no CURVE handshake with {self.address}: {what}; wrong server_key{key}, "
                "or not an llmgw server")

    def nothing_listens(self) -> bool:
        """TCP connects refused UNREACHABLE_RETRIES times in a row and none made: waiting
        out a Hello's whole bound there is time lost (a server that died, when another
        address may lead)."""
        return self.connects == 0 and self.retries >= UNREACHABLE_RETRIES

    def silence(self, waited: float) -> str:
        """Why nothing came back within `waited` seconds, as far as the monitor knows."""
        if self.succeeded:
            return (f"the server at {self.address} took this key but did not answer within "
                    f"{waited:g}s (overloaded, or stopping?)")
        if self.connects:
            return (f"{self.address} took the TCP connection but no CURVE handshake came "
                    f"within {waited:g}s: not an llmgw server?")
        refused = f", refused {self.retries} times" if self.retries else ""
        return (f"nothing answers at {self.address}: no TCP connection within {waited:g}s"
                f"{refused} (is `llmgw server` running there?)")


class Monitor:
    """The monitor socket of one DEALER, read without blocking trio."""

    def __init__(self, sock: zmq.Socket[Any], hlog: HandshakeLog) -> None:
        self._sock = sock
        self.log = hlog
        self._mon: TrioSocket | None = TrioSocket(sock.get_monitor_socket(EVENTS))

    def drain(self) -> HandshakeLog:
        """Fold every event queued so far; returns the log."""
        while self._mon is not None:
            frames = self._mon.recv_frames_nowait()
            if frames is None:
                break
            self._feed(frames)
        return self.log

    async def watch(self) -> LlmgwError:
        """Wait for a verdict (an auth refusal, a wrong server key); returns it."""
        await self._until(lambda hlog: hlog.verdict() is not None)
        found = self.log.verdict()
        assert found is not None
        return found

    async def until_nothing_listens(self) -> None:
        """Return once connects to the address have been refused again and again."""
        await self._until(HandshakeLog.nothing_listens)

    async def _until(self, done: Callable[[HandshakeLog], bool]) -> None:
        while not done(self.drain()):
            try:
                if self._mon is None:
                    raise trio.ClosedResourceError
                frames = await self._mon.recv_frames()
            except trio.ClosedResourceError:
                # Closed because the handshake is done: nothing more will come.
                await trio.sleep_forever()
                raise AssertionError("unreachable") from None
            self._feed(frames)

    def _feed(self, frames: list[zmq.Frame]) -> None:
        try:
            event = parse_monitor_message([f.bytes for f in frames])
        except (ValueError, TypeError, IndexError) as exc:
            log.debug("ignored a monitor message: %s", exc)
            return
        self.log.feed(int(event["event"]), int(event["value"]))

    def close(self) -> None:
        """Stop monitoring: once the handshake is done nobody reads the events, and they
        must not pile up in the monitor's queue for the life of a session."""
        if self._mon is None:
            return
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError as exc:
            log.debug("disable_monitor: %s", exc)
        self._mon.close()
        self._mon = None
