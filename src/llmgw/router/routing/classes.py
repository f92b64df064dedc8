"""Priority classes as the router's config names them, and the band of one request.

router.toml's `classes` lists them highest first, each with its queue ttl; without any
there is one, "default", waiting `queue_wait` (admission as it was before classes). A
request's class is its API key's (`priority_class`; a key that names none, and a request
without a key, get `default_class`), lowered, never raised, by the request's own
`x-llmgw-class` header (fairqueue.effective_band). A key naming a class this router does
not list waits in the lowest one: a typo must not lift a key above what was meant (logged
once per key and class).
"""

from __future__ import annotations

import logging

from llmgw.config.router import RouterConfig
from llmgw.router.errors import ApiError
from llmgw.router.routing.fairqueue import Band, effective_band

log = logging.getLogger("llmgw.router")

HEADER = b"x-llmgw-class"
DEFAULT = "default"  # the one class's name when none are configured
_MAX_WARNED = 1000  # (key, class) pairs logged about: bounded


class Classes:
    def __init__(self, config: RouterConfig) -> None:
        listed = config.classes
        if listed:
            n = len(listed)
            self.bands = tuple(Band(c.name, n - i, c.ttl) for i, c in enumerate(listed))
        else:
            self.bands = (Band(DEFAULT, 0, config.queue_wait),)
        self.by_name = {b.name: b for b in self.bands}
        self.default = self.by_name[config.default_class] if config.default_class else self.bands[0]
        self.lowest = self.bands[-1]
        self._warned: set[tuple[str, str]] = set()

    def vllm_priority(self, band: Band) -> int:
        """The engine's `priority` for `band`, as FairQueue.vllm_priority gives it: 0 for
        the highest class, one more for each below."""
        return self.bands.index(band)

    def of_key(self, name: str, klass: str) -> Band:
        """The band of a key called `name` whose class is `klass` ("": none)."""
        if not klass:
            return self.default
        band = self.by_name.get(klass)
        if band is not None:
            return band
        if (name, klass) not in self._warned and len(self._warned) < _MAX_WARNED:
            self._warned.add((name, klass))
            log.warning("API key %s names class %r, which this router does not list (%s): "
                        "its requests wait in the lowest, %s", name, klass,
                        ", ".join(self.by_name), self.lowest.name)
        return self.lowest

    def band(self, key_band: Band, asked: bytes | None) -> Band:
        """The band a request waits in: its key's, or the lower one its header asks for.
        An unknown class in the header is the client's mistake: 400."""
        if asked is None:
            return key_band
        want = self.by_name.get(asked.decode("latin-1").strip())
        if want is None:
            raise ApiError(400, f"{HEADER.decode()}: {asked[:40].decode('latin-1')!r} is not a "
                           "class of this router; expected one of " + ", ".join(self.by_name),
                           param=HEADER.decode(), code="unknown_class")
        return effective_band(key_band, want)
