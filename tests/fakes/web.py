"""HTTP clients for the live tests (not named http.py: fakes/supervisor_proc.py runs as a
script with this folder first on sys.path, where it would shadow the standard library): a
completion POSTed to a router on 127.0.0.1, and a JSON request by URL. Connection failures
are answers (status 0), not exceptions, since the tests poll with them until a router
or an engine serves. And what the tests read of answers: a stream's events, a series of
a /metrics page."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any, NamedTuple


class Reply(NamedTuple):
    status: int  # 0: no answer (refused, reset, timed out); body then says why
    headers: dict[str, str]  # names lower-cased
    body: bytes

    def json(self) -> Any:
        """The body as JSON; {"raw": its first 200 characters} where it is not JSON (a
        connection error's text, a refusal in plain text)."""
        try:
            return json.loads(self.body)
        except ValueError:
            return {"raw": self.body[:200].decode(errors="replace")}


def post(port: int, body: dict[str, Any], secret: str = "", *, timeout: float = 15,
         path: str = "/v1/completions") -> Reply:
    """`body` as JSON to the router on `port`, with `secret` as the bearer key if given."""
    headers = {"content-type": "application/json"}
    if secret:
        headers["authorization"] = f"Bearer {secret}"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), headers)
        r = conn.getresponse()
        return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    except OSError as exc:
        return Reply(0, {}, str(exc).encode())
    finally:
        conn.close()


def http_json(url: str, body: Any = None, *, timeout: float = 10,
              headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """GET `url` (POST `body` as JSON when given): the status and the JSON it answered,
    for error statuses too."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def events(raw: bytes) -> list[Any]:
    """A stream's events (its `data:` lines as JSON), without `[DONE]`."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: ") and block != "data: [DONE]":
            out.append(json.loads(block[len("data: "):]))
    return out


def series(text: str, name: str) -> float:
    """The sum of a Prometheus series over its label sets (exact name)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total
