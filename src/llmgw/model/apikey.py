"""API keys kept by the control plane (API keys and limits), pure: the record the store keeps, the
secret's shape, its hash, and the limits a key carries.

A secret is `llmgw-` and 43 characters of URL-safe base64 (32 random bytes): recognisable
in a log or a leaked file, high-entropy enough that a plain SHA-256 is the right hash (no
password stretching: nothing to guess). Only the hash is stored; the secret is printed
once by `ctl apikey create`. `prefix` (the first 12 characters) names a key in listings
without giving it away.
"""

from __future__ import annotations

import base64
import hashlib
import re
from typing import Any

from attrs import frozen

SECRET_PREFIX = "llmgw-"
SECRET_BYTES = 32
SHOWN = 12  # characters of the secret kept as its prefix
_SECRET = re.compile(r"^llmgw-[A-Za-z0-9_-]{43}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,99}$")
# A priority class's name (router.toml's `classes`, a key's class, the x-llmgw-class
# header): short, lowercase, fit for a metrics label.
_CLASS = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


def make_secret(random: bytes) -> str:
    """A secret from `random` (SECRET_BYTES of secrets.token_bytes: the caller's)."""
    if len(random) != SECRET_BYTES:
        raise ValueError(f"expected {SECRET_BYTES} random bytes, got {len(random)}")
    return SECRET_PREFIX + base64.urlsafe_b64encode(random).decode().rstrip("=")


def looks_like_secret(text: str) -> bool:
    return bool(_SECRET.match(text))


def hash_secret(secret: str | bytes) -> str:
    raw = secret.encode() if isinstance(secret, str) else secret
    return hashlib.sha256(raw).hexdigest()


def check_name(name: str) -> str | None:
    """None when `name` may name a key, else why not."""
    if not _NAME.match(name):
        return ("expected a name of letters, digits, '.', '_', '@' or '-' (at most 100), "
                f"got {name!r}")
    return None


def check_class(name: str) -> str | None:
    """None when `name` may name a priority class, else why not."""
    if not _CLASS.match(name):
        return ("expected a lowercase letter, then up to 31 lowercase letters, digits, '_' "
                f"or '-', got {name[:40]!r}")
    return None


@frozen
class Budget:
    """At most `tokens` (prompt + completion) per `period` seconds."""

    tokens: int
    period: float

    def plain(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "period": self.period}


@frozen
class ApiKeyRecord:
    name: str
    sha256: str  # of the secret
    prefix: str  # the secret's first SHOWN characters
    created: float = 0.0
    models: tuple[str, ...] = ()  # served names or adapters it may use; (): every one
    rpm: int = 0  # requests per minute; 0: no limit
    tpm: int = 0  # tokens per minute
    concurrency: int = 0  # requests at once
    budget: Budget | None = None
    expires: float = 0.0  # epoch seconds; 0: never
    revoked: float = 0.0  # when it was revoked; 0: it is not
    # What a router does once the leases it holds are spent and the server does not
    # answer: "" (the default: budgets refuse, rate limits admit), "allow" or "deny" (all).
    on_server_loss: str = ""
    # Its priority class, one of the routers' `classes` ("": the routers' default_class);
    # a request may lower it (x-llmgw-class), never raise it.
    priority_class: str = ""

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models

    def live(self, now: float) -> bool:
        """Usable now: not revoked, not expired."""
        return not self.revoked and (not self.expires or now < self.expires)

    def state(self, now: float) -> str:
        if self.revoked:
            return "revoked"
        if self.expires and now >= self.expires:
            return "expired"
        return "active"
