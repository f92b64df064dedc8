"""The routers this agent's KV-event relay may let in: the router keys the server
authorizes now, as its last RouterKeys message said.

The link replaces the whole set on each RouterKeys (level-triggered); the relay's ZAP
handler asks `allows` (or hands `lookup` to transport/zap.py's serve_zap) at each
connection, and may ask again per message, by the connection's User-Id, so that a key
revoked on the server stops being served without a reconnect. The set is one frozenset
swapped in whole: a reader on another thread sees the old set or the new one, never half.

Until the first RouterKeys (an agent just started, the server away) the set is empty and
no router is let in: the server alone says who is a router. A set once received is kept
while the server is away, so that routers keep following events as engines keep serving.
"""

from __future__ import annotations

import logging

from llmgw.transport.keys import KeyInfo

log = logging.getLogger(__name__)

Z85_KEY_LENGTH = 40  # a CURVE public key (32 bytes) in z85


class AuthorizedRouters:
    def __init__(self) -> None:
        self._keys: frozenset[bytes] = frozenset()
        # Has the server said at least once (an empty set from it is an answer too).
        self.received = False

    def update(self, keys: tuple[str, ...] | list[str]) -> None:
        """The server's whole set of router public keys (z85), replacing the last one. A
        value that is no z85 key is left out with a log line (it could match nothing)."""
        good = frozenset(k.encode() for k in keys if _z85_key(k))
        if len(good) != len(set(keys)):
            log.warning("ignored %d router key(s) from the server that are no z85 public keys",
                        len(set(keys)) - len(good))
        if good != self._keys or not self.received:
            log.info("routers authorized to follow KV events: %d", len(good))
        self._keys = good
        self.received = True

    def allows(self, public_key_z85: bytes) -> bool:
        """Whether a router with this public key (z85, as ZAP's User-Id carries it) may follow."""
        return public_key_z85 in self._keys

    def lookup(self, public_key_z85: bytes) -> KeyInfo | None:
        """For transport/zap.py's serve_zap: the key as a router's, or None (refused)."""
        if public_key_z85 not in self._keys:
            return None
        return KeyInfo(name="router", role="router", public_key=public_key_z85)

    @property
    def keys(self) -> frozenset[bytes]:
        return self._keys


def _z85_key(value: object) -> bool:
    return (isinstance(value, str) and len(value) == Z85_KEY_LENGTH and value.isascii()
            and value.isprintable() and " " not in value)
