"""One request to the server and its reply, as ctl and the router use it."""

from __future__ import annotations

import uuid
from typing import Any

import trio
import zmq

from llmgw import PROTOCOL_VERSION
from llmgw.errors import ProtocolError, RequestFailedError, ServerUnreachableError
from llmgw.transport import codec
from llmgw.transport.dealer import connect
from llmgw.transport.follow import NotLeaderError
from llmgw.transport.keys import load_pair, load_public
from llmgw.transport.messages import NotLeader, Refused, Reply, Request
from llmgw.transport.requests import Op

_CTX: zmq.Context[Any] | None = None


def _context() -> zmq.Context[Any]:
    global _CTX
    if _CTX is None:
        _CTX = zmq.Context()
    return _CTX


async def request(
    server: str,
    secret_key_file: str,
    server_key_file: str,
    op: Op,
    timeout: float = 5.0,
) -> Any:
    """Send `op` and return the reply's result; RequestFailedError when the server says no,
    ServerUnreachableError when nothing answers within `timeout`."""
    pair = load_pair(secret_key_file)
    server_public = load_public(server_key_file)
    req = Request(PROTOCOL_VERSION, uuid.uuid4().hex, op)
    with trio.move_on_after(timeout):
        async with connect(_context(), server, pair, server_public) as conn:
            await conn.send(codec.encode(req))
            while True:
                try:
                    msg = codec.decode(await conn.recv())
                except ProtocolError:
                    continue
                if isinstance(msg, Refused):
                    raise RequestFailedError(f"server refused: {msg.reason}")
                if isinstance(msg, NotLeader):
                    raise NotLeaderError(server, msg.leader)
                if isinstance(msg, Reply) and msg.request_id == req.request_id:
                    if not msg.ok:
                        raise RequestFailedError(msg.error)
                    return msg.result
    raise ServerUnreachableError(
        f"no answer from {server} within {timeout:g}s "
        "(is the server running there, and is this key authorized by it?)"
    )
