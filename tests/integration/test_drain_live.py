"""Graceful stops end to end (issue 20 item 2): a server, agents with simulated GPUs, a
router and a simulated engine streaming slowly, all real processes on loopback. Fifty
streams run through the router on one replica; then the replica is scaled away, its
deployment deleted, its node drained, or its spec rolled: every stream completes with its whole answer,
and only then is the engine stopped (well before drain_timeout: the agent reported it
idle). With `drain_timeout: 0s` (the old immediate stop) the same streams are cut.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from fakes.live import Cluster, Proc, engine_pids, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.live_long]  # waits out real windows: .ci/run -m live_long

STREAMS = 50
TOKENS = 40  # at 10 tokens a second: each stream runs about 4 s
DEPLOYMENT = """name: d
model: org/sim
engine: simulated
gpus_per_node: 1
replicas: 1
drain_timeout: {drain}
env:
  LLMGW_SIM_TOKENS_PER_SECOND: "10"
  LLMGW_SIM_TOKENS: "1000"
  LLMGW_SIM_TTFT: "{ttft}"
"""


class Rig:
    def __init__(self, c: Cluster) -> None:
        self.c = c
        self.root = c.root
        self.router_port = 0
        self.router: Proc | None = None

    def start(self, nodes: tuple[str, ...]) -> None:
        self.c.up(dict.fromkeys(nodes, {"discovery": {"simulated_gpus": 1}}))
        self.router, self.router_port = self.c.start_router()

    def apply(self, drain: str, ttft: str = "0.01") -> None:
        self.c.apply("d", DEPLOYMENT.format(drain=drain, ttft=ttft))

    def replicas(self) -> dict[str, dict[str, Any]]:
        return self.c.replicas()

    def serving(self) -> dict[str, Any]:
        """The one ready replica once the router serves it."""
        ready = wait_for(lambda: [r for r in self.replicas().values() if r["state"] == "ready"],
                         40, "a ready replica")
        got: dict[str, Any] = {}

        def serves() -> bool:
            got.update(stream(self.router_port, 1))
            assert self.router is not None and self.router.p.poll() is None, self.router.text()
            return bool(got["done"])
        try:
            wait_for(serves, 20, "the router serving it", interval=0.3)
        except AssertionError:
            assert self.router is not None
            raise AssertionError(f"{got}\n{self.router.text()[-3000:]}") from None
        return ready[0]  # type: ignore[no-any-return]

    def ctl(self, *args: str) -> None:
        self.c.ok(*args)


@pytest.fixture
def rig(make_cluster: Callable[..., Cluster]) -> Rig:
    # Routers poll every 1 s (the default); the agents read engines every 500 ms.
    return Rig(make_cluster(extra_server='drain_grace = "2s"\n'))


def stream(port: int, tokens: int, on_first: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """One streamed completion through the router on its own connection."""
    body = json.dumps({"model": "org/sim", "prompt": "p", "max_tokens": tokens,
                       "stream": True}).encode()
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
    except OSError as exc:
        return {"done": False, "why": str(exc)}
    with s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(body), body))
        buf = b""
        first = False
        while not buf.endswith(b"0\r\n\r\n"):
            try:
                data = s.recv(65536)
            except OSError as exc:
                return {"done": False, "why": str(exc), "body": buf}
            if not data:
                return {"done": False, "why": "closed", "body": buf}
            buf += data
            if b"\r\n\r\n" in buf and not buf.startswith(b"HTTP/1.1 200"):
                return {"done": False, "why": "refused", "body": buf}  # 503 while none is ready
            if not first and b"data: " in buf:
                first = True
                on_first()
    head, _, rest = buf.partition(b"\r\n\r\n")
    events = rest.count(b'"text":')
    # The whole answer: every token, the chunk with its finish_reason, then [DONE].
    ok = (head.startswith(b"HTTP/1.1 200") and b'"finish_reason":"length"' in rest
          and b"data: [DONE]" in rest and b'"error"' not in rest)
    return {"done": ok and events >= tokens, "why": "" if ok else "incomplete",
            "events": events, "body": rest[-300:],
            "end": time.monotonic()}


def run_streams(rig: Rig, stop: Callable[[], None],
                tokens: int = TOKENS) -> tuple[list[dict[str, Any]], float]:
    """STREAMS streams at once; once every one has its first event, `stop()`. Returns
    their results and when `stop()` was called."""
    started: list[int] = []
    with ThreadPoolExecutor(STREAMS) as pool:
        futs: list[Future[dict[str, Any]]] = [
            pool.submit(stream, rig.router_port, tokens, lambda: started.append(1))
            for _ in range(STREAMS)]
        wait_for(lambda: len(started) == STREAMS, 20, "every stream's first event")
        at = time.monotonic()
        stop()
        return [f.result(timeout=60) for f in futs], at


def engine_of(rig: Rig, replica: str) -> int:
    return next(p for p, tag in engine_pids(rig.root).items() if tag.startswith(replica))


def check_drained(rig: Rig, replica: dict[str, Any], stop: Callable[[], None],
                  alone: bool = True, tokens: int = TOKENS) -> None:
    """`alone`: the draining replica is the model's last, so once the router has dropped
    it a new request is refused (it would succeed if the router still sent it there)."""
    pid = engine_of(rig, replica["id"])
    seen: list[dict[str, Any]] = []
    seen_at: list[float] = []

    def stop_and_look() -> None:
        stop()
        seen.append(wait_for(lambda: (r := rig.replicas().get(replica["id"]))
                             and r["state"] == "draining" and r, 10, "the replica draining"))
        seen_at.append(time.monotonic())
        if alone:
            wait_for(lambda: stream(rig.router_port, 1)["why"] == "refused", 5,
                     "the router sending the draining replica nothing new")

    results, stopped_at = run_streams(rig, stop_and_look, tokens)
    cut = [r for r in results if not r["done"]]
    assert not cut, f"{len(cut)} of {STREAMS} streams cut: {cut[0]}"
    last = max(r["end"] for r in results)
    assert last - seen_at[0] > 0.5  # they ran on while it was draining
    row = seen[0]
    assert "stops once its requests finish, at most 30s" in row["reason"], row
    assert row["drain_until"] - row["drain_since"] == 30.0
    # Stopped once idle, long before drain_timeout.
    wait_for(lambda: pid not in engine_pids(rig.root), 15, "the drained engine stopped")
    assert time.monotonic() - stopped_at < 25.0
    assert replica["id"] not in rig.replicas()


def test_scale_down_drains_every_stream(rig: Rig) -> None:
    rig.start(("n1",))
    rig.apply("30s")
    replica = rig.serving()
    check_drained(rig, replica, lambda: rig.ctl("scale", "d", "--replicas", "0"))


def test_delete_drains_every_stream(rig: Rig) -> None:
    rig.start(("n1",))
    rig.apply("30s")
    replica = rig.serving()
    check_drained(rig, replica, lambda: rig.ctl("delete", "deployment", "d"))


def test_node_drain_moves_the_replica_and_drains_every_stream(rig: Rig) -> None:
    rig.start(("n1", "n2"))
    rig.apply("30s")
    replica = rig.serving()
    node = replica["nodes"][0]

    def drain() -> None:
        rig.ctl("drain", node)
        # The replacement becomes ready first; only then does the old one drain.
        wait_for(lambda: any(r["state"] == "ready" and r["nodes"] != [node]
                             for r in rig.replicas().values()), 30, "the replacement ready")

    check_drained(rig, replica, drain, alone=False)
    # New requests go to the replacement.
    assert stream(rig.router_port, 3)["done"]


def test_rolling_update_drains_the_old_replica(rig: Rig) -> None:
    rig.start(("n1", "n2"))
    rig.apply("30s")
    replica = rig.serving()

    def update() -> None:
        rig.apply("30s", ttft="0.02")  # a new template: surge one, then retire the old
        wait_for(lambda: any(r["state"] == "ready" and r["id"] != replica["id"]
                             for r in rig.replicas().values()), 30, "the new replica ready")

    # Longer streams (12 s): the old replica drains only once the surged one is ready,
    # which on a loaded machine takes seconds; they must still be running by then.
    check_drained(rig, replica, update, alone=False, tokens=3 * TOKENS)
    assert stream(rig.router_port, 3)["done"]


def test_without_a_drain_the_streams_are_cut(rig: Rig) -> None:
    """The control: drain_timeout 0 stops at once, as every stop did before, and the same
    streams end mid-answer (so the tests above can fail)."""
    rig.start(("n1",))
    rig.apply("0s")
    rig.serving()
    results, _ = run_streams(rig, lambda: rig.ctl("scale", "d", "--replicas", "0"))
    assert sum(not r["done"] for r in results) == STREAMS
