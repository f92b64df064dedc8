"""The supervisor starts each kv_events engine's KV-event receiver (agent/kvevents/feeds.py)
and feeds the relay: bound before the engine spawns, a new life at each start and at an
adoption, Gone when the engine exits or is stopped. The engine is a plain process that
only checks the events port is bound when it starts (the simulated engine publishes no
events); the events come from a fake publisher shaped as vLLM's (test_kv_receiver.py)."""

from __future__ import annotations

import os
import random
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import trio
import zmq
from test_kv_receiver import Publisher

from fakes.engines import free_port
from fakes.supervision import Reports
from fakes.supervisor_proc import config
from llmgw.agent.engines import LaunchPlan, ProcessPlan, kv_events
from llmgw.agent.kvevents.feeds import KvFeeds
from llmgw.agent.kvevents.relay import Relay
from llmgw.agent.kvevents.relay_serve import RelayService
from llmgw.agent.lifecycle.supervisor import Supervisor
from llmgw.model.deployment import KV_EVENTS_PUB
from llmgw.model.engine import EngineKind, EngineSpec, EngineState
from llmgw.transport.zap import serve_zap

# Connects to the events port once, says whether anything listened, then lives on.
PROBE = """
import socket, sys, time
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5).close()
    said = "bound"
except OSError as e:
    said = f"refused: {e}"
with open(sys.argv[2], "a") as f:
    f.write(said + "\\n")
time.sleep(600)
"""


class ProbePlan:
    def __init__(self, out: Path) -> None:
        self.out = out

    def __call__(self, spec: EngineSpec, indices: Mapping[str, int]) -> LaunchPlan:
        pub, _ = kv_events.ports(spec)
        argv = (sys.executable, "-c", PROBE, str(pub), str(self.out))
        return LaunchPlan((ProcessPlan("engine", argv),), health_checked=False)


def port_pair() -> int:
    """A port P with P and P + 1 both free: the events port and the replay port."""
    while True:
        p = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue


def kv_spec(rid: str, gen: int, pub_port: int) -> EngineSpec:
    return EngineSpec(rid, gen, "dep", "org/tiny", "tiny", EngineKind.VLLM, (), free_port(),
                      port_base=pub_port - KV_EVENTS_PUB, kv_events=True)


async def until(ok: Callable[[], bool]) -> None:
    with trio.fail_after(20):
        while not ok():
            await trio.sleep(0.01)


async def test_receivers_live_as_long_as_their_engines_and_each_start_is_a_new_life(
        tmp_path: Path) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    pub_port = port_pair()
    rid = f"kv-{os.getpid()}-0"
    probes = tmp_path / "probes"
    service = RelayService(Relay(random.Random(1)))
    reports = Reports()
    sup = Supervisor(config(str(tmp_path)), reports, plan=ProbePlan(probes),
                     kv=KvFeeds(service, ctx))
    publisher: Publisher | None = None
    pids: list[int] = []
    try:
        async with trio.open_nursery() as outer:  # the engine's publisher: it outlives agents
            # The relay's ZAP handler shares the agent's context; it refuses every key, and
            # the receivers' loopback sockets (no CURVE, no ZAP domain) never ask it.
            await outer.start(serve_zap, ctx, lambda key: None)
            async with trio.open_nursery() as nursery:
                await nursery.start(sup.serve)
                await sup.apply((kv_spec(rid, 1, pub_port),))
                pids.append((await reports.wait(rid, EngineState.READY)).pid)
                await until(probes.exists)
                assert probes.read_text() == "bound\n"  # bound before the engine spawned
                first = service.relay.position(rid)
                assert first is not None and first[1] == 0

                publisher = Publisher(ctx, pub_port, pub_port + 1, life=0, keep=100)
                await outer.start(publisher.serve_replays)
                await publisher.subscribed()
                for _ in range(3):
                    await publisher.publish()
                await until(lambda: service.relay.position(rid) == (first[0], 3))

                # The engine dies: its routers hear Gone. The server's next generation is
                # a new life, its receiver on the same port again.
                os.kill(pids[0], signal.SIGKILL)
                await reports.wait(rid, EngineState.EXITED)
                assert service.relay.position(rid) is None
                await sup.apply((kv_spec(rid, 2, pub_port),))
                pids.append((await reports.wait(rid, EngineState.READY, generation=2)).pid)
                second = service.relay.position(rid)
                assert second is not None and second[0] != first[0] and second[1] == 0
                await until(lambda: probes.read_text() == "bound\nbound\n")
                nursery.cancel_scope.cancel()  # the agent goes away; the engine stays

            # A new agent adopts the engine: a receiver and a new life; the publisher (past
            # seq 0) reconnects, and what its buffer holds comes back by replay.
            service2 = RelayService(Relay(random.Random(2)))
            sup2 = Supervisor(config(str(tmp_path)), Reports(), plan=ProbePlan(probes),
                              kv=KvFeeds(service2, ctx))
            async with trio.open_nursery() as nursery:
                await nursery.start(sup2.serve)
                adopted = service2.relay.position(rid)
                assert adopted is not None and adopted[1] == 0
                await publisher.publish()  # seq 3: a gap from 0, replayed from the buffer
                await until(lambda: (service2.relay.position(rid) or (0, 0))[1] == 4)
                assert [s for s, _ in service2.relay.held(rid)] == [0, 1, 2, 3]

                # Stopped by the desired set: Gone, and nothing listens on the port (a
                # bind as ZeroMQ's, past the closed connections' TIME_WAIT, succeeds).
                await sup2.apply(())
                assert service2.relay.position(rid) is None
                with trio.fail_after(10):
                    while True:
                        try:
                            with socket.socket() as s:
                                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                                s.bind(("127.0.0.1", pub_port))
                                s.listen()
                            break
                        except OSError:
                            await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
            await publisher.close()
            publisher = None
            outer.cancel_scope.cancel()
    finally:
        if publisher is not None:
            await publisher.close()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        ctx.destroy(linger=0)
