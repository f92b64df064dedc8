"""kv_aware routing on loopback: the router in-process before two simulated engines, and a
fake agent relay (a ROUTER socket, CURVE server with an agent's key pair, built here) that
answers the router's Follow with relay_wire's Life and batches. A prompt whose blocks the
relay says replica r1 holds goes to r1; a new life of r1 clears what it held; a model whose
tokenizer the router cannot read is served by prefix_affinity, and says so."""

from __future__ import annotations

import json
import random
import re
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import zmq
import zmq.auth
from test_router import MODEL, Source, config, engine

from fakes.engines import SimEngineProcess
from fakes.kv_tokenizer import ids, write_tokenizer
from llmgw.agent.kvevents.relay import Relay
from llmgw.agent.kvevents.relay_serve import RelayService, serve_kv_relay
from llmgw.agent.kvevents.routers import AuthorizedRouters
from llmgw.config.router import ModelRouteConfig, RouterKeysConfig
from llmgw.kvcache import relay_wire
from llmgw.kvcache.events import Batch, Stored
from llmgw.kvcache.relay_wire import Follow, Gone, Life, Message, RelayBatch
from llmgw.router.service import serve_router
from llmgw.transport.keys import KeyPair, load_pair
from llmgw.transport.zmqtrio import TrioSocket

BS = 4
PREFIX = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11"  # with the BOS: 3 full blocks
OTHER = "w150 w151 w152 w153 w154 w155 w156"  # 2 blocks, for r0: the block size is known


def stored(text: str, first_hash: int) -> Batch:
    toks = ids(text)
    n = len(toks) // BS
    return Batch(0.0, 0, None, (Stored(tuple(range(first_hash, first_hash + n)), None,
                                       tuple(toks[: n * BS]), BS),))


class FakeRelay:
    """An agent's relay socket: records each Follow, sends what the test says."""

    def __init__(self, ctx: zmq.Context[Any], bind: str = "tcp://127.0.0.1:0",
                 keys: tuple[bytes, bytes] | None = None) -> None:
        self.public, self.secret = keys or zmq.curve_keypair()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_server = True
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        try:
            sock.bind(bind)
        except zmq.ZMQError:
            sock.close()
            raise
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.ts = TrioSocket(sock)
        self.monitor = TrioSocket(sock.get_monitor_socket(zmq.EVENT_DISCONNECTED))
        self.follows: list[tuple[bytes, Follow]] = []
        self.seen = trio.Event()

    async def run(self) -> None:
        while True:
            try:
                frames = await self.ts.recv_multipart()
            except trio.ClosedResourceError:
                return  # the fixture's end
            msg = relay_wire.decode(frames[1:])
            assert isinstance(msg, Follow)
            self.follows.append((frames[0], msg))
            self.seen.set()

    async def follow(self, want: dict[str, Any]) -> bytes:
        """Wait for a Follow whose positions are `want`; the router's identity."""
        while True:
            for ident, f in self.follows:
                if dict(f.positions) == want:
                    return ident
            self.seen = trio.Event()
            await self.seen.wait()

    async def disconnected(self) -> None:
        """Wait for a router's connection to close."""
        await self.monitor.recv_multipart()

    def close(self) -> None:
        self.monitor.close()
        self.ts.close()

    async def send(self, ident: bytes, *msgs: Message) -> None:
        for m in msgs:
            await self.ts.send_multipart([ident, *relay_wire.encode(m)])


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[SimEngineProcess]]:
    engs = [engine(tmp_path), engine(tmp_path)]
    try:
        for e in engs:
            e.wait_healthy()
        yield engs
    finally:
        for e in engs:
            e.stop()


@pytest.fixture
async def relay(nursery: trio.Nursery) -> AsyncIterator[FakeRelay]:
    ctx: zmq.Context[Any] = zmq.Context()
    r = FakeRelay(ctx)
    try:
        nursery.start_soon(r.run)
        yield r
    finally:
        r.close()
        ctx.destroy(linger=0)


def router_key(tmp_path: Path) -> str:
    folder = tmp_path / "keys"
    folder.mkdir(exist_ok=True)
    _, secret = zmq.auth.create_certificates(str(folder), "router-1")
    return str(secret)


def kv_table(engs: list[SimEngineProcess], endpoint: str, keys: list[str], version: int = 1) -> dict[str, Any]:
    """Replica ri's events relayed at `endpoint` by the agent whose public key is keys[i]."""
    return {"version": version, "models": {MODEL: [
        {"replica_id": f"r{i}", "url": e.url, "ready": True, "kv": {"endpoint": endpoint, "key": key}}
        for i, (e, key) in enumerate(zip(engs, keys, strict=True))]}}


def table(engs: list[SimEngineProcess], relay: FakeRelay, bad_key: str = "", version: int = 1) -> dict[str, Any]:
    """Both replicas' events relayed by `relay`; `bad_key` names one whose row's agent key
    is no CURVE key."""
    # 40 printable characters, as the table's check wants, but no z85 (which has no '_').
    keys = ["_" * 40 if bad_key == f"r{i}" else relay.public.decode() for i in range(len(engs))]
    return kv_table(engs, relay.endpoint, keys, version)


async def start(nursery: trio.Nursery, source: Source, tmp_path: Path, tokenizer: Path) -> str:
    route = ModelRouteConfig(policy="kv_aware", tokenizer=str(tokenizer), kv_weight=1.0,
                             kv_speculative_ttl=0.0, prefix_chars=len(PREFIX))
    cfg = config(keys=RouterKeysConfig(secret_key=router_key(tmp_path), server_key=""),
                 models={MODEL: route})
    host, port = await nursery.start(
        lambda task_status: serve_router(cfg, table_source=source, task_status=task_status))
    while source.calls == 0:  # noqa: ASYNC110
        await trio.sleep(0.01)
    return f"http://{host}:{port}"


def http(url: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def get(url: str) -> str:
    return (await trio.to_thread.run_sync(http, url))[1]


async def complete(url: str, prompt: str) -> int:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3}
    return (await trio.to_thread.run_sync(http, url + "/v1/completions", body))[0]


async def generated(e: SimEngineProcess) -> float:
    m = re.search(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", await get(e.url + "/metrics"), re.M)
    assert m is not None
    return float(m.group(1))


async def served_by(engs: list[SimEngineProcess], url: str, prompt: str) -> list[int]:
    """Which engines served one request for `prompt` (by their generated tokens)."""
    before = [await generated(e) for e in engs]
    assert await complete(url, prompt) == 200
    after = [await generated(e) for e in engs]
    return [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a > b]


async def metric(url: str, line: str) -> float:
    m = re.search("^" + re.escape(line) + r" (\S+)$", await get(url + "/metrics"), re.M)
    return float(m.group(1)) if m else -1.0


async def until(url: str, line: str, value: float) -> None:
    with trio.fail_after(10):
        while await metric(url, line) != value:
            await trio.sleep(0.02)


async def test_a_prompt_goes_where_its_prefix_is_held_a_new_life_clears_it_the_table_ends_it(
        engines: list[SimEngineProcess], relay: FakeRelay, nursery: trio.Nursery, tmp_path: Path) -> None:
    source = Source(table(engines, relay))
    url = await start(nursery, source, tmp_path, write_tokenizer(tmp_path / "tok"))
    with trio.fail_after(10):
        router = await relay.follow({"r0": None, "r1": None})
    # r0 holds an unrelated prefix, r1 the prompt's: three blocks.
    await relay.send(router, Life("r0", 11, 0), RelayBatch("r0", 11, 0, stored(OTHER, 500)),
                     Life("r1", 22, 0), RelayBatch("r1", 22, 0, stored(PREFIX, 1000)))
    await until(url, f'llmgw_router_kv_index_blocks{{model="{MODEL}"}}', 5)
    for tail in ("w60", "w61 w62", "w63"):
        assert await served_by(engines, url, f"{PREFIX} {tail}") == [1]
    assert await metric(url, f'llmgw_router_kv_predicted_hit_blocks_total{{model="{MODEL}"}}') == 9
    # A prompt nobody holds: the tie goes to r0 (the lower id), as score.choose says.
    assert await served_by(engines, url, "w90 w91 w92 w93 w94 w95 w96 w97") == [0]
    # A new life of r1 (its engine restarted): what it held is gone from the index.
    await relay.send(router, Life("r1", 33, 0))
    await until(url, f'llmgw_router_kv_clears_total{{model="{MODEL}",why="life"}}', 3)
    await until(url, f'llmgw_router_kv_index_blocks{{model="{MODEL}"}}', 2)
    assert await served_by(engines, url, f"{PREFIX} w64") == [0]
    # The table names the relay no more: the link closes, what it filled is cleared.
    rows = table(engines, relay, version=2)
    for row in rows["models"][MODEL]:
        del row["kv"]
    source.snap = rows
    with trio.fail_after(10):
        await relay.disconnected()
    await until(url, f'llmgw_router_kv_clears_total{{model="{MODEL}",why="left"}}', 2)
    await until(url, f'llmgw_router_kv_index_blocks{{model="{MODEL}"}}', 0)


async def test_a_gap_asks_again_gone_waits_for_the_table_bad_frames_or_keys_cost_themselves(
        engines: list[SimEngineProcess], relay: FakeRelay, nursery: trio.Nursery, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    source = Source(table(engines, relay, bad_key="r0"))
    url = await start(nursery, source, tmp_path, write_tokenizer(tmp_path / "tok"))
    with trio.fail_after(10):
        router = await relay.follow({"r1": None})  # r0's row names no usable key
    assert "not followed: the agent's key is not a CURVE public key" in caplog.text
    await relay.ts.send_multipart([router, b"not", b"a relay message"])
    await relay.send(router, Life("r1", 22, 0), RelayBatch("r1", 22, 0, stored(OTHER, 500)),
                     RelayBatch("r1", 22, 2, stored(PREFIX, 1000)))  # seq 1 lost
    with trio.fail_after(10):
        await relay.follow({"r1": (22, 1)})  # asked again from where the router is
    await until(url, f'llmgw_router_kv_refollows_total{{model="{MODEL}"}}', 1)
    await until(url, f'llmgw_router_kv_index_blocks{{model="{MODEL}"}}', 2)  # seq 2 was not applied
    assert "dropped a message: kv relay: not an llmgw-kv/1 message" in caplog.text
    await relay.send(router, RelayBatch("r1", 22, 1, stored(PREFIX, 1000)))  # the answer
    await until(url, f'llmgw_router_kv_index_blocks{{model="{MODEL}"}}', 5)
    assert await served_by(engines, url, f"{PREFIX} w60") == [1]
    # Gone: cleared, and not asked for until the table changes (its engine may be back).
    relay.follows.clear()
    await relay.send(router, Gone("r1"))
    await until(url, f'llmgw_router_kv_index_blocks{{model="{MODEL}"}}', 0)
    source.snap = table(engines, relay, bad_key="r0", version=2)
    with trio.fail_after(10):
        await relay.follow({"r1": None})


async def test_a_tokenizer_the_router_cannot_read_leaves_the_model_to_prefix_affinity(
        engines: list[SimEngineProcess], relay: FakeRelay, nursery: trio.Nursery, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    url = await start(nursery, Source(table(engines, relay)), tmp_path, tmp_path / "no-tokenizer")
    assert "kv_aware routing is off, prefix_affinity instead" in caplog.text
    assert await metric(url, f'llmgw_router_kv_tokenizer_unavailable{{model="{MODEL}"}}') == 1
    # The same prefix, the same replica (the affinity ring), every time.
    first = await served_by(engines, url, f"{PREFIX} w60")
    assert len(first) == 1
    for tail in ("w61", "w62 w63"):
        assert await served_by(engines, url, f"{PREFIX} {tail}") == first
    assert await metric(url, f'llmgw_router_kv_fallbacks_total{{model="{MODEL}",why="tokenizer"}}') == 3
    assert relay.follows == []  # no index to fill: no relay followed


async def test_with_the_agents_own_relay(
        engines: list[SimEngineProcess], nursery: trio.Nursery, tmp_path: Path) -> None:
    """The same as the first test, with the agent's relay (agent/kvevents/relay_serve.py)
    in place of the fake: the router's key authorized, the engine's batches fed as a
    receiver feeds them."""
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        public, secret = zmq.curve_keypair()
        secret_file = router_key(tmp_path)
        routers = AuthorizedRouters()
        routers.update([load_pair(secret_file).public_key.decode()])
        service = RelayService(Relay(random.Random(7)))
        endpoint = await nursery.start(serve_kv_relay, ctx, service, "tcp://127.0.0.1:0",
                                       KeyPair(public, secret), routers)
        source = Source(kv_table(engines, endpoint, [public.decode()] * 2))
        route = ModelRouteConfig(policy="kv_aware", tokenizer=str(write_tokenizer(tmp_path / "tok")),
                                 kv_weight=1.0, kv_speculative_ttl=0.0, prefix_chars=len(PREFIX))
        cfg = config(keys=RouterKeysConfig(secret_key=secret_file, server_key=""), models={MODEL: route})
        host, port = await nursery.start(
            lambda task_status: serve_router(cfg, table_source=source, task_status=task_status))
        url = f"http://{host}:{port}"
        for replica, batch in (("r0", stored(OTHER, 500)), ("r1", stored(PREFIX, 1000))):
            service.new_life(replica)  # the engine started
            service.batch(replica, batch)
        await until(url, f'llmgw_router_kv_index_blocks{{model="{MODEL}"}}', 5)
        assert await served_by(engines, url, f"{PREFIX} w60") == [1]
        service.new_life("r1")  # its engine restarted
        await until(url, f'llmgw_router_kv_index_blocks{{model="{MODEL}"}}', 2)
        assert await served_by(engines, url, f"{PREFIX} w61") == [0]
        nursery.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)


async def test_an_agent_that_comes_back_is_followed_at_once(
        engines: list[SimEngineProcess], relay: FakeRelay, nursery: trio.Nursery, tmp_path: Path) -> None:
    """Its relay restarted (a new socket on the same address): the router's connection
    comes up again and it sends its Follow then, not at its next heartbeat."""
    url = await start(nursery, Source(table(engines, relay)), tmp_path, write_tokenizer(tmp_path / "tok"))
    with trio.fail_after(10):
        router = await relay.follow({"r0": None, "r1": None})
    await relay.send(router, Life("r0", 11, 0), Life("r1", 22, 0))
    await until(url, f'llmgw_router_kv_clears_total{{model="{MODEL}",why="life"}}', 2)
    relay.close()
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        with trio.fail_after(10):
            while True:  # libzmq lets the address go in its own thread, a moment after close
                try:
                    again = FakeRelay(ctx, relay.endpoint, (relay.public, relay.secret))
                    break
                except zmq.ZMQError:
                    await trio.sleep(0.01)
        nursery.start_soon(again.run)
        with trio.fail_after(relay_wire.FOLLOW_EVERY / 2):  # well before the heartbeat
            await again.follow({"r0": (11, 0), "r1": (22, 0)})
        again.close()
    finally:
        ctx.destroy(linger=0)
