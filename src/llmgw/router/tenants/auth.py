"""Optional API keys: a TOML file of SHA-256 hashes, names and allowed models.

    [[key]]
    name = "team-a"
    sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    models = ["llama-3-8b"]        # optional; absent or ["*"]: every model
    class = "batch"                # optional: its priority class (router.toml's classes)

Clients send `Authorization: Bearer <key>`. The file is read again when its mtime or size
changes (checked at most once per `check_every` seconds; time is passed in). A file that
becomes unreadable or invalid keeps the last good set and is logged once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tomllib

import attrs

from llmgw.errors import ConfigError
from llmgw.model.apikey import check_class

log = logging.getLogger("llmgw.router.tenants.auth")


@attrs.frozen
class ApiKey:
    name: str
    models: frozenset[str] | None  # None: every model
    priority_class: str = ""  # "": the router's default_class

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_keys(text: str, path: str) -> dict[str, ApiKey]:
    """sha256 hex → ApiKey. Raises ConfigError naming the file and the entry."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, "", f"not valid TOML: {exc}") from exc
    extra = set(data) - {"key"}
    if extra:
        raise ConfigError(path, sorted(extra)[0], "unknown key; expected [[key]] entries")
    out: dict[str, ApiKey] = {}
    for i, entry in enumerate(data.get("key", [])):
        where = f"key[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(path, where, "must be a table")
        unknown = set(entry) - {"name", "sha256", "models", "class"}
        if unknown:
            raise ConfigError(path, f"{where}.{sorted(unknown)[0]}", "unknown key")
        name = entry.get("name")
        digest = entry.get("sha256")
        if not isinstance(name, str) or not name:
            raise ConfigError(path, f"{where}.name", "missing or not a string")
        if (
            not isinstance(digest, str)
            or len(digest) != 64
            or any(c not in "0123456789abcdefABCDEF" for c in digest)
        ):
            raise ConfigError(path, f"{where}.sha256", f"not a SHA-256 hex digest: {digest!r}")
        models = entry.get("models")
        allowed: frozenset[str] | None
        if models is None:
            allowed = None
        elif isinstance(models, list) and all(isinstance(m, str) for m in models):
            allowed = None if "*" in models else frozenset(models)
        else:
            raise ConfigError(path, f"{where}.models", "must be a list of served model names")
        klass = entry.get("class", "")
        if not isinstance(klass, str):
            raise ConfigError(path, f"{where}.class", "must be a priority class's name")
        why = check_class(klass) if klass else None
        if why:
            raise ConfigError(path, f"{where}.class", why)
        out[digest.lower()] = ApiKey(name, allowed, klass)
    return out


class KeyFile:
    def __init__(self, path: str, check_every: float = 1.0) -> None:
        self.path = path
        self.check_every = check_every
        self._stamp: tuple[int, int] | None = None
        self._next_check = -1e18
        self._keys: dict[str, ApiKey] = {}
        self._failing = False
        self._cache: dict[bytes, ApiKey | None] = {}
        self.reload(0.0, force=True)

    def reload(self, now: float, force: bool = False) -> None:
        self._next_check = now + self.check_every
        try:
            st = os.stat(self.path)
        except OSError as exc:
            self._fail(f"cannot read API key file {self.path}: {exc.strerror}")
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp and not force:
            return
        try:
            with open(self.path, encoding="utf-8") as f:
                keys = parse_keys(f.read(), self.path)
        except (OSError, ConfigError, UnicodeDecodeError) as exc:
            self._fail(str(exc))
            return
        self._stamp = stamp
        self._keys = keys
        self._cache = {}
        if self._failing:
            log.info("API key file %s readable again", self.path)
        self._failing = False
        log.info("loaded %d API keys from %s", len(keys), self.path)

    def _fail(self, message: str) -> None:
        if not self._failing:
            log.warning("%s; keeping the last good keys", message)
        self._failing = True

    def check(self, authorization: bytes | None, now: float) -> ApiKey | None:
        """The key for an Authorization header value, or None (answer 401)."""
        if now >= self._next_check:
            self.reload(now)
        if not authorization:
            return None
        cached = self._cache.get(authorization)
        if cached is not None or authorization in self._cache:
            return cached
        scheme, _, token = authorization.partition(b" ")
        key = None
        if scheme.lower() == b"bearer" and token:
            key = self._keys.get(hashlib.sha256(token.strip()).hexdigest())
        if len(self._cache) > 4096:
            self._cache.clear()
        self._cache[authorization] = key
        return key
