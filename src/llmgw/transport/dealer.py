"""The client side of the wire: a CURVE DEALER connection to the server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import zmq

from llmgw.transport.handshake import HandshakeLog, Monitor
from llmgw.transport.keys import KeyPair
from llmgw.transport.zmqtrio import TrioSocket


class ZmqConnection:
    def __init__(self, sock: TrioSocket, monitor: Monitor) -> None:
        self.sock = sock
        # Watches the handshake until the first message proves it done (handshake.py).
        self.monitor = monitor

    async def send(self, payload: bytes) -> None:
        await self.sock.send_multipart([payload])

    async def recv(self) -> bytes:
        while True:
            parts = await self.sock.recv_multipart()
            self.monitor.close()
            if len(parts) == 1:
                return parts[0]

    def explain_silence(self, waited: float) -> str:
        """Why the server has not answered in `waited` seconds: nothing listens, our key
        was refused, its key is not the one we hold..."""
        hlog = self.monitor.drain()
        found = hlog.verdict()
        return str(found) if found is not None else hlog.silence(waited)


@asynccontextmanager
async def connect(
    ctx: zmq.Context[Any], server: str, pair: KeyPair, server_public: bytes,
    *, server_key_file: str = "",
) -> AsyncIterator[ZmqConnection]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # Queue nothing for a connection that is not up: a heartbeat delivered late to a
    # server that came back is noise.
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.setsockopt(zmq.RECONNECT_IVL, 200)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
    # No ZMTP heartbeats (HEARTBEAT_IVL): each PING costs the server's I/O thread a
    # CURVE message in and a PONG out, for every agent every few seconds, and tells the
    # application nothing. What it would find, a dead server or a half-open connection,
    # the agent's link finds first: it gives up on a server silent for 3 heartbeat
    # intervals (agent/link.py; no ack is silence too) and opens a new socket. ctl and the
    # router ask one request per connection under a timeout (client.py), and their quick
    # "nothing answers" comes from the socket monitor, not from heartbeats. The agent
    # sends every interval, so its connection is never idle and TCP keepalive would
    # never probe; the server keeps keepalive for peers that go quiet (server/peers/service.py).
    sock.curve_secretkey = pair.secret_key
    sock.curve_publickey = pair.public_key
    sock.curve_serverkey = server_public
    with TrioSocket(sock) as ts:
        monitor = Monitor(sock, HandshakeLog(server, server_key_file))
        try:
            sock.connect(server)
            yield ZmqConnection(ts, monitor)
        finally:
            monitor.close()
