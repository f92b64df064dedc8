"""Following the leader among several server addresses (agents, routers, ctl).

A standby answers everything with NotLeader naming the leader; whoever asked goes there
if that address is in its own list, else to the next address in the list. A connection
that never came up moves to the next address too; one that was up and broke tries its
address once more first (a single server that restarted). The caller keeps its own
backoff between attempts.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from llmgw.errors import ServerUnreachableError

log = logging.getLogger(__name__)

NO_LEADER_PAUSE = 0.25  # seconds between asks while the standbys know no leader (an election)


class NotLeaderError(ServerUnreachableError):
    """The server that answered is a standby."""

    def __init__(self, server: str, leader: str) -> None:
        super().__init__(f"{server} is a standby; the leader is "
                         f"{leader if leader else 'not known yet (an election is under way)'}")
        self.server = server
        self.leader = leader


class Follower:
    """Which of `addresses` to try next. Pure: no sockets, no clock."""

    def __init__(self, addresses: Sequence[str]) -> None:
        if not addresses:
            raise ValueError("no server address")
        self.addresses = tuple(addresses)
        self.index = 0
        self._hint = ""
        self._up = True  # the current address answered since it was picked

    @property
    def current(self) -> str:
        return self.addresses[self.index]

    def pick(self) -> str:
        """The address to connect to now."""
        if self._hint in self.addresses:
            self.index = self.addresses.index(self._hint)
        elif not self._up:
            self.index = (self.index + 1) % len(self.addresses)
        self._hint, self._up = "", False
        return self.current

    def connected(self) -> None:
        """The current address answered as the leader."""
        self._up = True

    def redirected(self, leader: str) -> None:
        """The current address is a standby; `leader` is who it says leads ("" unknown)."""
        self._hint = leader if leader != self.current else ""
        self._up = False


Request = Callable[[str, str, str, Any, float], Awaitable[Any]]


class LeaderClient:
    """One request at a time to whichever of the addresses leads, within one timeout.
    With one address it is exactly `request` (llmgw.transport.client.request)."""

    def __init__(self, addresses: Sequence[str], request: Request) -> None:
        self.follower = Follower(addresses)
        self.request = request

    async def __call__(self, secret_key_file: str, server_key_file: str, op: Any,
                       timeout: float = 5.0) -> Any:
        n = len(self.follower.addresses)
        deadline = trio.current_time() + timeout
        # Several addresses: one that is down must not eat the whole timeout.
        per_try = timeout if n == 1 else max(1.0, timeout / n)
        last: ServerUnreachableError | None = None
        left = timeout  # the first try gets exactly the caller's timeout (one address)
        while left > 0:
            address = self.follower.pick()
            try:
                result = await self.request(address, secret_key_file, server_key_file, op,
                                            min(per_try, left))
            except NotLeaderError as exc:
                self.follower.redirected(exc.leader)
                last = exc
                if not exc.leader or exc.leader not in self.follower.addresses:
                    await trio.sleep(min(NO_LEADER_PAUSE, max(0.0, deadline - trio.current_time())))
                left = deadline - trio.current_time()
                continue
            except ServerUnreachableError as exc:
                last = exc
                left = deadline - trio.current_time()
                continue
            self.follower.connected()
            return result
        if last is None:
            last = ServerUnreachableError(f"no answer from {', '.join(self.follower.addresses)} "
                                          f"within {timeout:g}s")
        raise last
