"""What tests of the supervisor collect: its reports, and a chat request to an engine."""

from __future__ import annotations

import http.client
import json

import trio

from llmgw.model.engine import EngineReport, EngineState


class Reports:
    """An on_report callback that keeps every report, in order."""

    def __init__(self) -> None:
        self.seen: list[EngineReport] = []

    def __call__(self, r: EngineReport) -> None:
        self.seen.append(r)

    def states(self) -> list[EngineState]:
        return [r.state for r in self.seen]

    def last(self, rid: str) -> EngineReport | None:
        mine = [r for r in self.seen if r.replica_id == rid]
        return mine[-1] if mine else None

    async def wait(self, rid: str, state: EngineState, timeout: float = 15,
                   generation: int | None = None) -> EngineReport:
        """The latest report of `rid` in `state` (of `generation`, when given), once there
        is one. Give the generation wherever an older one of the same replica may still
        report: its READY is not the new engine's."""
        with trio.fail_after(timeout):
            while True:
                for r in reversed(self.seen):
                    if r.replica_id == rid and r.state is state and generation in (None, r.generation):
                        return r
                await trio.sleep(0.05)


def chat(port: int, name: str, timeout: float = 10) -> int:
    """POST /v1/chat/completions to an engine on 127.0.0.1; its status."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        body = json.dumps({"model": name, "messages": [{"role": "user", "content": "hi"}]})
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()
