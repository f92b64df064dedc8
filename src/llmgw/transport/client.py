"""One request to the server and its reply, as ctl and the router use it."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import trio
import zmq

from llmgw import PROTOCOL_VERSION
from llmgw.config.addresses import AddressError, parse_tcp
from llmgw.errors import (
    LlmgwError,
    ProtocolError,
    RefusedError,
    RequestFailedError,
    ServerUnreachableError,
    UsageError,
)
from llmgw.transport import codec
from llmgw.transport.dealer import ZmqConnection, connect
from llmgw.transport.follow import LeaderClient, NotLeaderError
from llmgw.transport.keys import load_pair, load_public
from llmgw.transport.messages import NotLeader, Refused, Reply, Request
from llmgw.transport.requests import Op

_CTX: zmq.Context[Any] | None = None


def check_address(address: str) -> str | None:
    """None when `address` is a server address llmgw dials (tcp://host:port, the grammar
    of config/addresses.py that every config check uses too), else what is wrong with it."""
    try:
        parse_tcp(address)
    except AddressError as exc:
        return str(exc)
    return None


def _context() -> zmq.Context[Any]:
    global _CTX
    if _CTX is None:
        _CTX = zmq.Context()
    return _CTX


async def _exchange(conn: ZmqConnection, server: str, req: Request) -> Any:
    await conn.send(codec.encode(req))
    while True:
        try:
            msg = codec.decode(await conn.recv())
        except ProtocolError:
            continue
        if isinstance(msg, Refused):
            raise RefusedError(f"the server at {server} refused this key: {msg.reason}")
        if isinstance(msg, NotLeader):
            raise NotLeaderError(server, msg.leader)
        if isinstance(msg, Reply) and msg.request_id == req.request_id:
            if not msg.ok:
                raise RequestFailedError(msg.error)
            return msg.result


async def request(
    server: str,
    secret_key_file: str,
    server_key_file: str,
    op: Op,
    timeout: float = 5.0,
) -> Any:
    """Send `op` and return the reply's result. Raises RequestFailedError when the server
    says no; RefusedError or HandshakeError (at once, not at the timeout) when our key
    or its key does not check out; ServerUnreachableError, saying what the socket saw,
    when nothing answers within `timeout`."""
    wrong = check_address(server)
    if wrong is not None:
        raise UsageError(f"server address {server!r}: {wrong}")
    pair = load_pair(secret_key_file)
    server_public = load_public(server_key_file)
    req = Request(PROTOCOL_VERSION, uuid.uuid4().hex, op)
    # The first of: the reply (or the server's error), or the monitor's verdict on the
    # handshake. Outcomes, not exceptions, leave the tasks: callers catch plain errors.
    done: list[tuple[bool, Any]] = []
    async with connect(_context(), server, pair, server_public,
                       server_key_file=server_key_file) as conn:
        with trio.move_on_after(timeout):
            async with trio.open_nursery() as nursery:

                async def reply() -> None:
                    try:
                        done.append((True, await _exchange(conn, server, req)))
                    except LlmgwError as exc:
                        done.append((False, exc))
                    nursery.cancel_scope.cancel()

                async def handshake() -> None:
                    done.append((False, await conn.monitor.watch()))
                    nursery.cancel_scope.cancel()

                nursery.start_soon(reply)
                nursery.start_soon(handshake)
        if not done:
            raise ServerUnreachableError(conn.explain_silence(timeout))
    ok, value = done[0]
    if not ok:
        raise value
    return value


async def request_leader(servers: Sequence[str], secret_key_file: str, server_key_file: str,
                         op: Any, timeout: float = 5.0) -> Any:
    """`request` to whichever of `servers` leads (ctl: one request per run)."""
    return await LeaderClient(servers, request)(secret_key_file, server_key_file, op, timeout)
