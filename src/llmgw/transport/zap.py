"""The server's ZAP handler, as a trio task in the server's zmq context.

libzmq accepts any CURVE client when no ZAP handler answers, so serve_zap must have
started (bound) before the server binds its ROUTER. The User-Id it hands back is the
public key (z85) that authenticated the connection: it arrives with every message on that
connection, and the server looks the key up in the authorized set as it is then, so what
a connection may do follows from its key, never from a name that can be issued again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio
import zmq

from llmgw.logbound import Throttle, clip
from llmgw.transport.keys import KeyInfo, KeyPair
from llmgw.transport.zmqtrio import TrioSocket

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
# Plain ints: pyzmq's recv_multipart/send_multipart do IntFlag arithmetic per frame.
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
BURST = 256  # ZAP requests answered per wake-up, at most


def curve_server(sock: zmq.Socket[Any], pair: KeyPair) -> None:
    """Make `sock` a CURVE server with `pair`, its clients checked by this module's ZAP
    handler (domain "llmgw"), and its dead peers found by TCP keepalive: a connection
    whose peer vanished (host down, network cut) is found by the kernel's probes, with no
    ZMTP PING to every peer every few seconds (each a CURVE message each way through
    libzmq's I/O thread: a quarter of its work at 2,000 agents on the server)."""
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 10)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
    sock.curve_server = True
    sock.curve_secretkey = pair.secret_key
    sock.curve_publickey = pair.public_key
    sock.zap_domain = b"llmgw"


def user_id(info: KeyInfo) -> str:
    return info.public_key.decode()


_refusals = Throttle()


def zap_reply(frames: list[bytes], lookup: Callable[[bytes], KeyInfo | None]) -> list[bytes]:
    """Pure: a ZAP request's frames -> the reply's frames."""
    if len(frames) < 6:
        return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
    version, request_id, _domain, address, _identity, mechanism = frames[:6]
    if version != b"1.0":
        return [b"1.0", request_id, b"500", b"unsupported ZAP version", b"", b""]
    if mechanism != b"CURVE" or len(frames) < 7:
        return [b"1.0", request_id, b"400", b"CURVE required", b"", b""]
    public = zmq.utils.z85.encode(frames[6])
    info = lookup(public)
    if info is None:
        _refusals.log(log, logging.WARNING, address, "refused unknown key %s from %s", public.decode(),
                      clip(address.decode(errors="replace"), 100))
        return [b"1.0", request_id, b"400", b"unknown key", b"", b""]
    return [b"1.0", request_id, b"200", b"OK", user_id(info).encode(), b""]


async def serve_zap(
    ctx: zmq.Context[Any],
    lookup: Callable[[bytes], KeyInfo | None],
    *,
    on_denied: Callable[[str], None] = lambda reason: None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    with TrioSocket(ctx.socket(zmq.REP)) as sock:
        raw = sock.sock
        # inproc, fed by libzmq alone; bounded all the same, like every server-side socket.
        raw.setsockopt(zmq.MAXMSGSIZE, 4096)
        raw.bind(ZAP_ENDPOINT)
        task_status.started()
        while True:
            await sock.wait_readable()
            # A burst per wake-up (a restarted server meets every agent's key at once):
            # REP takes the next request once this one is answered, so receive, reply
            # and receive again while ZMQ_EVENTS shows one queued, with the socket's
            # own calls (no `Again` at the end of each burst, no scheduler round each).
            # At most BURST, then the other tasks (heartbeats) get their turn.
            for _ in range(BURST):
                if not sock.readable():
                    break
                try:
                    frames = [raw.recv(_NOBLOCK)]
                except zmq.Again:
                    break
                while raw.get(_RCVMORE):  # a message's frames arrive together
                    frames.append(raw.recv(_NOBLOCK))
                reply = zap_reply(frames, lookup)
                if reply[2] != b"200":
                    on_denied(reply[3].decode())  # our own fixed text, e.g. "unknown key"
                try:
                    raw.send(reply[0], _NOBLOCK_MORE)  # once the first frame is in, all are
                except zmq.Again:  # never seen on inproc; REP must reply before its next recv
                    await sock.send_multipart(reply)
                    continue
                for part in reply[1:-1]:
                    raw.send(part, _NOBLOCK_MORE)
                raw.send(reply[-1], _NOBLOCK)
            else:
                await trio.lowlevel.checkpoint()
