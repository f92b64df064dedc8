"""What a client connection's failure is, and what a bug costs: `unexpected` finds the bug
in what ended a connection (not cancellation, not a client that went away), `cancel_part`
what must be re-raised, `crashed` answers, logs and counts the bug."""

from __future__ import annotations

import logging
import traceback

import trio

from llmgw.logbound import Throttle, clip
from llmgw.router import errors
from llmgw.router.connection.http import ClientConn
from llmgw.router.errors import JSON
from llmgw.router.metrics import RouterMetrics

log = logging.getLogger("llmgw.router")


_GONE = (trio.BrokenResourceError, trio.ClosedResourceError)


def unexpected(exc: BaseException) -> BaseException | None:
    """What in `exc` (maybe an exception group) is a bug rather than cancellation or the
    client (or an engine mid-answer) going away; None when nothing is."""
    if isinstance(exc, BaseExceptionGroup):
        rest = exc.split(Exception)[0]
        if rest is None:
            return None
        rest = rest.split(_GONE)[1]
        return rest
    if isinstance(exc, _GONE):
        log.debug("connection ended: %s", exc)
        return None
    if isinstance(exc, Exception):
        return exc
    return None


def cancel_part(exc: BaseException) -> BaseException | None:
    """What in `exc` is not an Exception (trio.Cancelled, KeyboardInterrupt): re-raised."""
    if isinstance(exc, BaseExceptionGroup):
        rest = exc.split(Exception)[1]
        return exc if rest is not None and rest.exceptions == exc.exceptions else rest
    return None if isinstance(exc, Exception) else exc


async def crashed(client: ClientConn, exc: BaseException, metrics: RouterMetrics,
                  crash_log: Throttle) -> None:
    """A bug cost this connection: counted, logged (throttled, clipped), answered 500
    when no response head went out yet."""
    metrics.handler_errors += 1
    metrics.count("", 500)
    leaf = exc
    while isinstance(leaf, BaseExceptionGroup) and leaf.exceptions:
        leaf = leaf.exceptions[0]  # the connection's nursery wraps what its body raised
    name = type(leaf).__name__
    where = "".join(traceback.format_tb(leaf.__traceback__)[-3:])
    crash_log.log(
        log,
        logging.ERROR,
        name,
        "client connection failed: %s: %s\n%s",
        name,
        clip(leaf, 500),
        where[-1500:],
    )
    if client.can_respond and not client.eof:
        err = errors.internal()
        # Shielded (the handler may be being cancelled too), at most a second.
        with trio.CancelScope(shield=True, deadline=trio.current_time() + 1):
            try:
                await client.respond(500, JSON, err.body(), close=True)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
                log.debug("could not send the 500: %s", e)
