"""A one-off HTTP/1.1 GET over trio, read with `ResponseParser`: the agent's /health
probe and `llmgw dev`'s checks of its own router. (The router's own engine connections
are pooled: llmgw.router.upstream.)"""

from __future__ import annotations

import logging

import trio

from llmgw.http1.grammar import H1Error
from llmgw.http1.response import ResponseParser

log = logging.getLogger(__name__)

RECV = 65536


async def get(
    host: str, port: int, path: str, *, timeout: float, head_only: bool = False,
    user_agent: str = "llmgw",
) -> tuple[int, bytes]:
    """GET `path` with `Connection: close`; (status, body), the body b"" with `head_only`
    (the answer's head is all that is read). (0, b"") when nothing answers within
    `timeout`: refused, hung, broken, or not HTTP/1.1 as llmgw reads it."""
    request = (
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Connection: close\r\nUser-Agent: {user_agent}\r\n\r\n"
    ).encode()
    with trio.move_on_after(timeout):
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError as exc:
            log.debug("GET http://%s:%d%s: %s", host, port, path, exc)
            return 0, b""
        async with stream:
            parser = ResponseParser()
            try:
                await stream.send_all(request)
                while (head := parser.head()) is None:
                    _more(parser, await stream.receive_some(RECV))
                if head_only:
                    return head.status, b""
                while (body := parser.body()) is None:
                    _more(parser, await stream.receive_some(RECV))
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, H1Error) as exc:
                log.debug("GET http://%s:%d%s: %s", host, port, path, exc)
                return 0, b""
            return head.status, body
    return 0, b""


def _more(parser: ResponseParser, data: bytes) -> None:
    if data:
        parser.feed(bytes(data))
    else:
        parser.eof()
