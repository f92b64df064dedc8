"""The server's HTTP listener: /metrics for Prometheus, and the status page at / with the
JSON it polls (/status.json: the document `ctl status -o json` prints). Read-only.

The page is plain HTML, CSS and JavaScript shipped in the package (llmgw/server/web/):
nothing is fetched from anywhere but this listener.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import resources

import trio
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from llmgw.config.server import ServerConfig
from llmgw.http1.listen import Handler, HttpRequest, Response, Route
from llmgw.http1.serve import serve_http
from llmgw.server.metrics import ServerMetrics
from llmgw.server.orchestrator import Orchestrator
from llmgw.server.status import status_document

# The page loads its script and style from here and talks to nothing else.
PAGE_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
               "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8"}


def _static(name: str) -> Response:
    body = resources.files("llmgw.server").joinpath("web", name).read_bytes()
    ctype = _TYPES[name[name.rindex("."):]]
    return Response(200, body, ctype, headers=(("Content-Security-Policy", PAGE_POLICY),))


def server_routes(orchestrator: Orchestrator, metrics: ServerMetrics,
                  clock: Callable[[], float]) -> dict[str, Route]:
    page, script, style = _static("index.html"), _static("status.js"), _static("status.css")

    async def get_metrics(req: HttpRequest) -> Response:
        return Response(200, generate_latest(metrics.registry), CONTENT_TYPE_LATEST)

    async def get_status(req: HttpRequest) -> Response:
        doc = status_document(orchestrator, clock())
        return Response(200, json.dumps(doc, default=str).encode(), "application/json")

    def const(resp: Response) -> Handler:
        async def handler(req: HttpRequest) -> Response:
            return resp

        return handler

    return {
        "/metrics": Route(get_metrics),
        "/status.json": Route(get_status),
        "/": Route(const(page)),
        "/static/status.js": Route(const(script), private=False),
        "/static/status.css": Route(const(style), private=False),
    }


async def serve_server_http(
    config: ServerConfig,
    orchestrator: Orchestrator,
    metrics: ServerMetrics,
    clock: Callable[[], float],
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The listener on `config.metrics_bind` until cancelled; started() gets its address."""
    await serve_http(config.metrics_bind, server_routes(orchestrator, metrics, clock),
                     token=config.metrics_token, name="server metrics and status page",
                     task_status=task_status)
