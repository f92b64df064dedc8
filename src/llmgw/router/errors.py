"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with a status."""

from __future__ import annotations

import json

JSON = b"application/json"  # the content type of an error's body (and of the router's JSON)


class ApiError(Exception):
    """An answer to the client that is an error. Raised inside the router, never escapes."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after: int = 0,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.retry_after = retry_after  # seconds; 0: no Retry-After header

    def headers(self) -> bytes:
        return b"retry-after: %d\r\n" % self.retry_after if self.retry_after else b""

    def payload(self) -> dict[str, object]:
        return error_payload(self.message, self.type, self.code, self.param)

    def body(self) -> bytes:
        return json.dumps(self.payload()).encode()


def error_payload(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> dict[str, object]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse_error_event(message: str, code: str = "upstream_error") -> bytes:
    """The SSE event that ends a stream whose engine failed after the first byte."""
    body = json.dumps(error_payload(message, "server_error", code))
    return b"data: " + body.encode() + b"\n\n"


def bad_json(detail: str) -> ApiError:
    return ApiError(400, f"We could not parse the JSON body of your request: {detail}")


def no_model() -> ApiError:
    return ApiError(400, "you must provide a model parameter", param="model")


def unknown_model(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key")


def not_ready(model: str, why: str) -> ApiError:
    """Deployed, serving nothing yet: not the 404 a typo gets."""
    return ApiError(503, f"`{model}` is deployed but has no ready replica: {why}",
                    type_="server_error", code="model_not_ready", retry_after=5)


def no_replica(model: str) -> ApiError:
    return ApiError(
        503,
        f"no replica of `{model}` is ready to serve; try again shortly",
        type_="server_error",
        code="no_ready_replica",
    )


def overloaded(model: str, detail: str, retry_after: int = 1) -> ApiError:
    """The router cannot take the request now (its queue for the model is full, or the
    request waited its whole `queue_wait`): the router's trouble, not an engine's."""
    return ApiError(
        503,
        f"the router is overloaded for `{model}` ({detail}); try again shortly",
        type_="server_error",
        code="server_overloaded",
        retry_after=retry_after,
    )


def cold(model: str, detail: str, retry_after: int = 5) -> ApiError:
    """A model scaled to zero did not get a ready replica in time for this request (or
    too many wait for one already): 503 with Retry-After, as an overload is."""
    return ApiError(
        503,
        f"`{model}` is starting from zero replicas ({detail}); try again shortly",
        type_="server_error",
        code="model_starting",
        retry_after=retry_after,
    )


def upstream_failed(model: str, detail: str) -> ApiError:
    return ApiError(
        502,
        f"every replica of `{model}` tried failed: {detail}",
        type_="server_error",
        code="upstream_error",
    )


def not_found(path: str) -> ApiError:
    return ApiError(404, f"no route for {path}", code="not_found")


def method_not_allowed(method: str, path: str) -> ApiError:
    return ApiError(405, f"{method} is not allowed on {path}", code="method_not_allowed")


_PROTOCOL_CODES = {
    400: "bad_request",
    408: "request_timeout",
    413: "request_too_large",
    431: "request_header_fields_too_large",
}


def protocol(status: int, detail: str) -> ApiError:
    """A request the HTTP parser refused (llmgw.http1 H1Error), as an OpenAI-shaped error."""
    if status == 413:
        return ApiError(413, detail, code="request_too_large")
    return ApiError(status, f"malformed HTTP request: {detail}", code=_PROTOCOL_CODES.get(status))


def internal() -> ApiError:
    return ApiError(
        500, "the router failed on this request; it was logged", type_="server_error", code="internal_error"
    )


def too_deep(limit: int) -> ApiError:
    return ApiError(400, f"We could not parse the JSON body of your request: nested deeper than {limit}")
