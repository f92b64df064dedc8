"""Mid-stream failover, the trio shell: a stream whose engine failed after the client got
part of it goes on on another ready replica, into the same client response.

`follow_for` decides per request (a model's `failover_migrations`, resume.refusal);
`carry_on` runs after the relay raised Migrate: it builds the continuation (resume.Stream),
picks a replica not tried yet and relays the continuation, at most `migrations` times per
request, each continuation's head due within `failover_timeout` of the break. Where the
stream cannot go on (refused, no replica left, no migration left, the deadline passed) it
ends as a stream without failover does: with the error event.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

from llmgw.router.connection.relay import ClientGone, Failed, Migrate, Relay
from llmgw.router.connection.resume import KINDS, Follow, Stream, refusal
from llmgw.router.exchange import Exchange
from llmgw.router.routing.balancer import Replica

log = logging.getLogger("llmgw.router")

# Replicas asked for one continuation (each refused before its first byte), as the tries
# before a first byte.
TRIES = 3


def follow_for(path: bytes, body: dict[str, Any], sent_asks_usage: bool) -> Follow | None:
    """The follower of a request whose stream may be resumed; None when it may not.
    `sent_asks_usage`: the body sent to the first engine asks for the usage event."""
    if refusal(path, body) is not None:
        return None
    return Follow(Stream(KINDS[path], body, sent_asks_usage))


def asks_usage(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    return isinstance(opts, dict) and opts.get("include_usage") is True


async def carry_on(
    relay: Relay,
    ex: Exchange,
    choose: Callable[[tuple[Replica, ...]], Replica | None],
    failed: Callable[[str, Replica, str], None],
    broke: Replica,
    why: str,
    *,
    migrations: int,
    timeout: float,
    status: int,
    takes_priority: Callable[[Replica], bool] = lambda r: False,
) -> int:
    """Go on after `broke` failed mid-stream (`why`); returns the status the client got
    (`status`, that of the first answer's head), 499 when the client went away.
    `takes_priority`: the replica's engine schedules by the body's `priority` (the
    exchange's `engine` then writes the field for it, routing/priority.py: a client's own
    never reaches an engine, after a failover either)."""
    follow = ex.follow
    assert follow is not None
    s = follow.stream
    tried: tuple[Replica, ...] = (broke,)
    model = ex.model
    while True:
        if s.finished:
            # The client has the whole answer; only the end was lost.
            await relay.end_stream(ex, why, whole=True)
            relay.metrics.failover(model, "whole")
            return status
        refused = s.resumable()
        if refused is None and migrations <= 0:
            refused = "no migration left"
        body = s.next_body() if refused is None else None
        if refused is None and body is None:
            refused = "the token limit was reached"
        if refused is not None or body is None:
            log.info("stream of %s not resumed after %s: %s", model, why, refused)
            await relay.end_stream(ex, why)
            relay.metrics.failover(model, "refused")
            return status
        migrations -= 1
        deadline = trio.current_time() + timeout
        went_on = False
        failure = "no other ready replica"
        for _ in range(TRIES):
            r = choose(tried)
            if r is None:
                break
            if trio.current_time() >= deadline:
                failure = f"no replica answered within {timeout:g}s"
                break
            tried += (r,)
            ex.body = body if ex.engine is None else ex.engine.for_continuation(body, takes_priority(r))
            follow.restart()
            r.outstanding += 1
            try:
                await relay.run(ex, r, deadline=deadline)
                log.info("stream of %s went on on replica %s after %s", model, r.replica_id, why)
                relay.metrics.failover(model, "resumed")
                return status
            except ClientGone:
                return 499
            except Migrate as m:
                log.info("stream of %s went on on replica %s after %s, and broke again",
                         model, r.replica_id, why)
                relay.metrics.failover(model, "resumed")
                why = m.why
                went_on = True
                break
            except Failed as f:
                failure = f"replica {r.replica_id}: {f}"
                if f.eject:
                    failed(model, r, str(f))
                if not f.retry:
                    break
            finally:
                r.outstanding -= 1
        if not went_on:
            log.info("stream of %s not resumed after %s: %s", model, why, failure)
            await relay.end_stream(ex, f"{why}; not resumed: {failure}")
            relay.metrics.failover(model, "failed")
            return status
