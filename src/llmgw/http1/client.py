"""One-off HTTP/1.1 exchanges over trio (`Connection: close`), read with ResponseParser:
the agent's /health probe and its LoRA adapter calls, and `llmgw dev`'s checks of its own
router. (The router's own engine connections are pooled: llmgw.router.connection.upstream.)"""

from __future__ import annotations

import logging

import trio

from llmgw.errors import LlmgwError
from llmgw.http1.grammar import H1Error
from llmgw.http1.response import ResponseParser

log = logging.getLogger(__name__)

RECV = 65536
MAX_ANSWER = 16 * 1024 * 1024  # bytes of an answer read whole (head and body)


class NoAnswer(LlmgwError):
    """Nothing usable came back: refused, hung, broken, too large, or not HTTP/1.1 as
    llmgw reads it. The message says which."""


async def request(
    host: str, port: int, method: str, path: str, body: bytes = b"", *, timeout: float,
    headers: tuple[tuple[str, str], ...] = (), head_only: bool = False,
    max_answer: int = MAX_ANSWER, user_agent: str = "llmgw",
) -> tuple[int, bytes]:
    """(status, body) of one exchange; the body b"" with `head_only` (only the answer's
    head is read). A body is sent with its Content-Length. Raises NoAnswer."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close",
             f"User-Agent: {user_agent}", *(f"{k}: {v}" for k, v in headers)]
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
    with trio.move_on_after(timeout):
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError as exc:
            raise NoAnswer(str(exc.strerror or exc)) from None
        async with stream:
            parser = ResponseParser()
            got = 0
            try:
                await stream.send_all(data)
                while (head := parser.head()) is None:
                    got += _more(parser, await stream.receive_some(RECV), got, max_answer)
                if head_only:
                    return head.status, b""
                while (answer := parser.body()) is None:
                    got += _more(parser, await stream.receive_some(RECV), got, max_answer)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise NoAnswer(f"connection broken: {exc}") from None
            except H1Error as exc:
                raise NoAnswer(f"not an HTTP/1.1 answer: {exc.message}") from None
            return head.status, answer
    raise NoAnswer(f"no answer within {timeout:g}s")


async def get(
    host: str, port: int, path: str, *, timeout: float, head_only: bool = False,
    user_agent: str = "llmgw",
) -> tuple[int, bytes]:
    """GET `path`: (status, body), or (0, b"") when no answer came within `timeout`."""
    try:
        return await request(host, port, "GET", path, timeout=timeout, head_only=head_only,
                             user_agent=user_agent)
    except NoAnswer as exc:
        log.debug("GET http://%s:%d%s: %s", host, port, path, exc)
        return 0, b""


def _more(parser: ResponseParser, data: bytes, got: int, limit: int) -> int:
    if not data:
        parser.eof()
        return 0
    if got + len(data) > limit:
        raise NoAnswer(f"answer larger than {limit} bytes")
    parser.feed(bytes(data))
    return len(data)
