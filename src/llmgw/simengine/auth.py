"""Which requests the simulated engine refuses with 401, as the real engines would.

Pure. The engine is given its key the ways the real ones take it (args.py):

- vLLM's shape: `--api-key K...` or VLLM_API_KEY (the flag wins), checked by vLLM's own
  middleware on paths under /v1, /v2, /inference and /cohere only (vllm 0.32
  entrypoints/serve/middleware/authenticate.py GUARDED_PREFIX; OPTIONS passes); and with
  `--middleware llmgw_engine_guard.EngineKeyGuard` (llmgw's guard, agent/engines/guard/),
  every path but GET/HEAD /health against VLLM_API_KEY.
- SGLang's shape: `--api-key K`, or `api_key:` in the YAML file of `--config`, checked on
  every path but OPTIONS and those starting /health, /ready or /metrics (sglang 0.5.23
  utils/auth.py decide_request_auth).

A key is `Authorization: Bearer <key>` (the scheme in any case). SGLang also takes
`x-api-key`; llmgw never sends it, so neither does this copy.
"""

from __future__ import annotations

import hmac

from attrs import frozen

VLLM_GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")
SGLANG_OPEN_PREFIX = ("/health", "/ready", "/metrics")
GUARD_MIDDLEWARE = "llmgw_engine_guard.EngineKeyGuard"


@frozen
class KeyCheck:
    """What the engine was told. `vllm_keys`: vLLM's own check (or SGLang's key, in
    `sglang_key`); `guard_key`: llmgw's guard, "" when it is not loaded."""

    shape: str = "vllm"
    vllm_keys: tuple[str, ...] = ()
    guard_key: str = ""
    sglang_key: str = ""


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token if scheme.lower() == "bearer" else None


def _matches(token: str | None, keys: tuple[str, ...]) -> bool:
    if token is None:
        return False
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(token.encode(), key.encode())
    return ok


def refused(check: KeyCheck, method: str, path: str, authorization: str | None) -> bool:
    """Whether the real engine (with llmgw's guard where loaded) answers this with 401."""
    token = _bearer(authorization)
    if check.shape == "sglang":
        if not check.sglang_key or method == "OPTIONS" or path.startswith(SGLANG_OPEN_PREFIX):
            return False
        return not _matches(token, (check.sglang_key,))
    # llmgw's guard is the outermost middleware: it answers first.
    if check.guard_key and not (path == "/health" and method in ("GET", "HEAD")):
        if not _matches(token, (check.guard_key,)):
            return True
    if check.vllm_keys and method != "OPTIONS" and path.startswith(VLLM_GUARDED_PREFIX):
        return not _matches(token, check.vllm_keys)
    return False
