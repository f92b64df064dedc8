"""An ASGI middleware that llmgw hands to vLLM (`--middleware
llmgw_engine_guard.EngineKeyGuard`, this folder on PYTHONPATH): every path but
GET /health answers 401 without `Authorization: Bearer <the engine's key>`.

Why: vLLM's own --api-key / VLLM_API_KEY check (vllm 0.32
entrypoints/serve/middleware/authenticate.py, AuthenticationMiddleware) guards only
paths under /v1, /v2, /inference and /cohere. /metrics, /sleep, /wake_up, /is_sleeping,
/collective_rpc (any worker method), /reset_prefix_cache, /server_info, /invocations and
the RLHF weight updates stay open to anyone on the management network. /health stays
open: it says nothing but "up", and a probe without a secret is what a load balancer or
an operator's curl needs.

Stand-alone on purpose: it runs inside the engine's own Python, which has no llmgw
installed, so it imports nothing beyond the standard library (not even starlette). vLLM
applies a class with `app.add_middleware(cls)` (no arguments), so the key comes from the
environment: VLLM_API_KEY, the variable vLLM's own check reads, so both checks hold the
same key. Without one it refuses to start rather than serve everything open.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

KEY_ENV = "VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})
_BODY = b'{"error": "Unauthorized"}'


class EngineKeyGuard:
    def __init__(self, app: App, *args: Any, **kwargs: Any) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV, "")
        if not key:
            raise RuntimeError(f"llmgw_engine_guard: {KEY_ENV} is not set; refusing to serve "
                               "every endpoint without a key")
        # Compared as digests, as vLLM does: equal lengths, constant time.
        self._digest = hashlib.sha256(key.encode()).digest()

    def allowed(self, scope: Scope) -> bool:
        path = scope.get("path", "")
        root = scope.get("root_path", "") or ""
        if root and path.startswith(root):
            path = path[len(root):]
        if path in OPEN_PATHS and scope.get("method", "GET") in ("GET", "HEAD"):
            return True
        for name, value in scope.get("headers", ()):
            if name.lower() != b"authorization":
                continue
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer":
                return hmac.compare_digest(hashlib.sha256(token).digest(), self._digest)
            return False
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            # Closing before accepting makes the server answer the handshake with 403.
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(_BODY)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": _BODY})
