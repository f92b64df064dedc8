"""One exchange through the router, as one record: the client's request and what the router
learns of it on the way (the model, the API key, stream or not, the usage tap, the body
sent on instead of the client's, the affinity key). The proxy fills it in, its tries and
the relay read it; nothing here does I/O."""

from __future__ import annotations

import attrs

from llmgw.http1.request import Request
from llmgw.model.apikey import ApiKeyRecord
from llmgw.router.connection.http import ClientConn
from llmgw.router.connection.resume import Follow
from llmgw.router.kv.policy import KvModel
from llmgw.router.routing.priority import EngineBodies
from llmgw.router.tenants.auth import ApiKey
from llmgw.router.tenants.usage import UsageTap


@attrs.define(eq=False)
class Exchange:
    client: ClientConn
    req: Request
    path: bytes  # the target without its query
    t0: float  # when the request came, on trio's clock
    model: str = ""  # set once the request named a model that can be served
    key: ApiKey | ApiKeyRecord | None = None  # the client's API key, where keys are on
    streaming: bool = False
    tap: UsageTap | None = None  # usage metering (API keys and limits): sees the answer
    body: bytes | None = None  # sent to the engine instead of the client's (a metered stream)
    affinity: str | None = None  # the prompt's prefix key, where the pool routes by it
    # A stream that may go on on another replica when its engine fails (resume.py).
    follow: Follow | None = None
    # kv_aware: the model whose index routes it and the prompt's block keys (router/kv/).
    kv: tuple[KvModel, list[int]] | None = None
    # The body per kind of engine (the `priority` field, routing/priority.py): set where it
    # may differ from `body`; each try then sets `body` from it for its replica.
    engine: EngineBodies | None = None
