"""The `priority` field an engine gets: the request's class, or nothing of the client's.

An engine started with `--scheduling-policy priority` (vLLM; the endpoint table marks its
rows `priority`) orders its own waiting queue and its preemptions by the body's
`priority`, lower first (fairqueue.py's docstring has vLLM's lines). So the router writes
the field itself, `fairqueue.vllm_priority` of the request's band, over whatever the
client sent: a client must not lift itself on the engine past the class its key has. To
any other engine the client's field is not passed on either (an engine under "fcfs"
ignores it today; one restarted with the priority policy would not). A body that needs
neither (no client field, and the highest band, which is vLLM's default 0) goes as it
came, byte for byte: the common case costs a dict lookup.

Pure: the parsed body in, the bytes to send out (None: the client's, or the metered
stream's body, unchanged).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

FIELD = "priority"

UsageBody = Callable[[dict[str, Any], bytes], "bytes | None"]


def rewrite(body: dict[str, Any], priority: int | None) -> dict[str, Any] | None:
    """The body with `priority` set (an int) or removed (None); None when the client's
    needs no change. A client's own field is always written over, even with the same
    value: a body may carry the key twice, and the bytes decide which one an engine reads."""
    if FIELD not in body and not priority:
        return None
    new = dict(body)  # keeps the client's key order
    if priority is None:
        del new[FIELD]
    else:
        new[FIELD] = priority
    return new


class EngineBodies:
    """One request's bodies: for an engine that takes priority, for one that does not;
    each made once, when a try first goes to such an engine."""

    __slots__ = ("body", "sent", "priority", "usage", "_made")

    def __init__(self, body: dict[str, Any], sent: bytes | None, priority: int,
                 usage: UsageBody | None) -> None:
        self.body = body  # the client's, parsed
        self.sent = sent  # what goes when nothing changes (None: the client's bytes)
        self.priority = priority  # the band's value for an engine that takes it
        self.usage = usage  # a metered stream: asks the engine for usage (usage_body)
        self._made: dict[bool, bytes | None] = {}

    def for_engine(self, takes_priority: bool) -> bytes | None:
        made = self._made
        if takes_priority in made:
            return made[takes_priority]
        new = rewrite(self.body, self.priority if takes_priority else None)
        if new is None:
            out = self.sent
        else:
            raw = json.dumps(new).encode()
            out = raw if self.usage is None else (self.usage(new, raw) or raw)
        made[takes_priority] = out
        return out

    def for_continuation(self, raw: bytes, takes_priority: bool) -> bytes:
        """A mid-stream failover's continuation (connection/resume.py builds it from the
        client's body) with the field as `for_engine` gives it: it goes to a replica of its
        own, which may schedule by priority or not."""
        new = rewrite(json.loads(raw), self.priority if takes_priority else None)
        return raw if new is None else json.dumps(new).encode()
