"""Priority classes and the fair queue in the router, on loopback: the router in-process
in front of a small fake engine (a trio HTTP/1.1 server in this file) that records each
request's body in the order it arrives and holds it a while. With one slot per replica,
the order the engine sees is the order the router's queue served.

- a flood from key A delays key B's request by no more than one of A's (round-robin);
- a batch-class request waits behind an interactive one, and a request lowered to batch
  by its x-llmgw-class header waits as batch;
- a class's ttl sheds with 503 server_overloaded and Retry-After, counted per class;
- the `priority` field: written over the client's for an engine the table marks as
  scheduling by priority, removed for any other.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import trio
from test_router import Source, start_router

from llmgw.config.router import ClassConfig

CLASSES = (ClassConfig("interactive", 10.0), ClassConfig("batch", 60.0))
SECRETS = {"a": "sk-a", "b": "sk-b", "c": "sk-c"}  # c is a batch key


class FakeEngine:
    """Answers /v1/completions with a small JSON completion after `hold` seconds (a
    request whose prompt starts with "slow" after `slow`), recording each body as it came;
    /metrics and /health answer at once."""

    def __init__(self, hold: float = 0.1, slow: float = 2.0) -> None:
        self.hold = hold
        self.slow = slow
        self.bodies: list[dict[str, Any]] = []
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._conn, listeners)

    async def _conn(self, s: trio.SocketStream) -> None:
        buf = b""
        async with s:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = await s.receive_some(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                m = re.search(rb"content-length:\s*(\d+)", head, re.I)
                n = int(m.group(1)) if m else 0
                while len(buf) < n:
                    buf += await s.receive_some(65536)
                body, buf = buf[:n], buf[n:]
                if head.startswith(b"POST /v1/completions"):
                    req = json.loads(body)
                    self.bodies.append(req)
                    await trio.sleep(self.slow if str(req.get("prompt")).startswith("slow")
                                     else self.hold)
                    out = json.dumps({"id": "c", "object": "text_completion", "model": req["model"],
                                      "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                                      "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                                "total_tokens": 2}}).encode()
                else:
                    out = b""
                await s.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(out), out))

    def prompts(self) -> list[str]:
        return [str(b["prompt"]) for b in self.bodies]


def keys_file(tmp_path: Path) -> str:
    f = tmp_path / "keys.toml"
    f.write_text("".join(
        f'[[key]]\nname = "{name}"\nsha256 = "{hashlib.sha256(s.encode()).hexdigest()}"\n'
        + ('class = "batch"\n' if name == "c" else "") for name, s in SECRETS.items()))
    return str(f)


def table(eng: FakeEngine, **models: bool) -> dict[str, Any]:
    """Each model one replica on `eng`, marked as scheduling by priority where True."""
    return {"version": 1, "models": {
        m: [{"replica_id": f"r-{m}", "url": eng.url, "ready": True, **({"priority": True} if p else {})}]
        for m, p in models.items()}}


async def post(url: str, body: dict[str, Any], key: str = "",
               klass: str = "") -> tuple[int, str, dict[str, Any]]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    raw = json.dumps(body).encode()
    extra = (f"authorization: Bearer {SECRETS[key]}\r\n" if key else "") + \
        (f"x-llmgw-class: {klass}\r\n" if klass else "")
    s = await trio.open_tcp_stream(host, int(port))
    async with s:
        await s.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\nconnection: close\r\n"
                         b"content-type: application/json\r\n%scontent-length: %d\r\n\r\n%s"
                         % (extra.encode(), len(raw), raw))
        buf = b""
        while data := await s.receive_some(65536):
            buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    return int(head.split()[1]), head.decode().lower(), json.loads(rest)


async def metrics_text(url: str) -> str:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    s = await trio.open_tcp_stream(host, int(port))
    async with s:
        await s.send_all(b"GET /metrics HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
        buf = b""
        while data := await s.receive_some(65536):
            buf += data
    return buf.decode()


async def start(nursery: trio.Nursery, tmp_path: Path, eng: FakeEngine, **kw: Any) -> str:
    await nursery.start(eng.serve)
    models = kw.pop("models", {"fake": False})
    kw.setdefault("classes", CLASSES)
    return await start_router(nursery, Source(table(eng, **models)), api_keys_file=keys_file(tmp_path),
                              max_requests_per_replica=1, **kw)


async def burst(url: str, plan: list[tuple[str, str, str]]) -> dict[str, int]:
    """A slow request takes the one slot; then `plan` (prompt, key, class header) arrives
    in order while it runs. The status of each."""
    got: dict[str, int] = {}

    async def one(prompt: str, key: str, klass: str) -> None:
        got[prompt] = (await post(url, {"model": "fake", "prompt": prompt, "max_tokens": 1},
                                  key, klass))[0]

    async with trio.open_nursery() as n:
        n.start_soon(one, "slow", "a", "")
        await trio.sleep(0.2)
        for prompt, key, klass in plan:
            n.start_soon(one, prompt, key, klass)
            await trio.sleep(0.05)  # arrive in order
    return got


async def test_a_flood_from_one_key_does_not_delay_another_beyond_its_turn(
        tmp_path: Path, nursery: trio.Nursery) -> None:
    eng = FakeEngine()
    url = await start(nursery, tmp_path, eng)
    plan = [(f"a{i}", "a", "") for i in range(5)] + [("b0", "b", ""), ("b1", "b", "")]
    with trio.fail_after(20):
        got = await burst(url, plan)
    assert set(got.values()) == {200}, got
    # Each key its turn: b's first goes right after a's first, its second after a's second.
    assert eng.prompts() == ["slow", "a0", "b0", "a1", "b1", "a2", "a3", "a4"]
    text = await metrics_text(url)
    assert re.search(r'llmgw_router_queue_wait_seconds_count\{class="interactive",model="fake"\} 8\.0',
                     text), text


async def test_a_batch_request_waits_behind_an_interactive_one(
        tmp_path: Path, nursery: trio.Nursery) -> None:
    eng = FakeEngine()
    url = await start(nursery, tmp_path, eng)
    # c is a batch key; b lowers one of its own requests to batch, and cannot raise c's.
    plan = [("c-batch", "c", ""), ("b-lowered", "b", "batch"), ("c-raised", "c", "interactive"),
            ("b-inter", "b", "")]
    with trio.fail_after(20):
        got = await burst(url, plan)
    assert set(got.values()) == {200}, got
    assert eng.prompts() == ["slow", "b-inter", "c-batch", "b-lowered", "c-raised"]
    status, _, err = await post(url, {"model": "fake", "prompt": "x"}, "b", "urgent")
    assert status == 400 and err["error"]["code"] == "unknown_class"


async def test_a_classes_ttl_sheds_with_503_and_retry_after(
        tmp_path: Path, nursery: trio.Nursery) -> None:
    eng = FakeEngine(slow=1.5)
    url = await start(nursery, tmp_path, eng, classes=(ClassConfig("interactive", 0.3),
                                                       ClassConfig("batch", 60.0)))
    shed: dict[str, Any] = {}

    async def interactive() -> None:
        t0 = trio.current_time()
        status, head, body = await post(url, {"model": "fake", "prompt": "i"}, "b")
        shed.update(status=status, head=head, body=body, after=trio.current_time() - t0)

    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            n.start_soon(post, url, {"model": "fake", "prompt": "slow"}, "a")
            await trio.sleep(0.2)
            n.start_soon(interactive)
            n.start_soon(post, url, {"model": "fake", "prompt": "batch"}, "c")
    assert shed["status"] == 503 and "retry-after: 1" in shed["head"], shed
    assert shed["body"]["error"]["code"] == "server_overloaded"
    assert 0.25 < shed["after"] < 1.2
    assert eng.prompts() == ["slow", "batch"]  # the batch request waited on, within its ttl
    text = await metrics_text(url)
    assert 'llmgw_router_queue_shed_total{class="interactive",model="fake",why="queue_timeout"} 1.0' \
        in text, text
    assert 'llmgw_router_refused_total{model="fake",why="queue_timeout"} 1.0' in text


async def test_the_priority_field_as_the_engine_sees_it(tmp_path: Path, nursery: trio.Nursery) -> None:
    eng = FakeEngine(hold=0.0)
    url = await start(nursery, tmp_path, eng, models={"prio": True, "plain": False})
    sent = [("prio", "c", {"priority": -100}), ("prio", "b", {"priority": -100}), ("prio", "b", {}),
            ("prio", "b", {}, "batch"), ("plain", "c", {"priority": -100}), ("plain", "b", {})]
    with trio.fail_after(20):
        for model, key, extra, *klass in sent:
            status, _, _ = await post(url, {"model": model, "prompt": "p", **extra}, key, *klass)
            assert status == 200
    seen = [b.get("priority", "absent") for b in eng.bodies]
    # Batch (the second class) is 1 on a priority engine, interactive 0 (vLLM's default, so
    # a body without the field goes as it came); a client's value never gets through.
    assert seen == [1, 0, "absent", 1, "absent", "absent"]
    assert all(b["prompt"] == "p" and b["model"] in ("prio", "plain") for b in eng.bodies)
