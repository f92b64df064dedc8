"""The simulated engine's process: signals, simulated load time and crash, the gang,
and the HTTP server, in one nursery."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from functools import partial

import trio

from llmgw.errors import UsageError
from llmgw.simengine.api import SimEngine
from llmgw.simengine.args import SimArgs, parse_args
from llmgw.simengine.gang import GangBroken, join_gang, serve_rendezvous
from llmgw.simengine.http import Exchange, serve_connection
from llmgw.simengine.weights import READ_WEIGHTS_ENV, check_weights

log = logging.getLogger("llmgw.simengine")

CRASH_EXIT_CODE = 3
GANG_EXIT_CODE = 1
# How long rank 0 answers /health with 503 after a member left, before it exits.
DEAD_EXIT_DELAY = 2.0


class _Run:
    def __init__(self, args: SimArgs, scope: trio.CancelScope) -> None:
        self.args = args
        self.engine = SimEngine(args)
        self.code = 0
        self._scope = scope

    def finish(self, code: int, why: str) -> None:
        if code:
            log.error("exiting with code %d: %s", code, why)
        else:
            log.info("exiting: %s", why)
        self.code = code
        self._scope.cancel()

    async def signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
            async for signum in received:
                if signum == signal.SIGTERM and self.args.ignore_sigterm:
                    log.warning("SIGTERM received and ignored (LLMGW_SIM_IGNORE_SIGTERM)")
                    continue
                self.finish(0, f"{signal.Signals(signum).name} received, shutting down")
                return

    async def crash_later(self, seconds: float) -> None:
        await trio.sleep(seconds)
        self.finish(CRASH_EXIT_CODE, f"simulated crash after {seconds:g}s (LLMGW_SIM_EXIT_AFTER)")

    async def member(self) -> None:
        try:
            await join_gang(self.args)
        except GangBroken as exc:
            self.finish(GANG_EXIT_CODE, f"{exc}; a gang member cannot go on without rank 0")

    async def watch_gang(self, lost: trio.MemoryReceiveChannel[int]) -> None:
        async for rank in lost:
            self.engine.dead_reason = f"rank {rank} left the gang"
            log.error("engine dead: rank %d left the gang; /health now answers 503", rank)
            if not self.args.keep_alive_on_death:
                await trio.sleep(DEAD_EXIT_DELAY)
                self.finish(GANG_EXIT_CODE, f"rank {rank} left the gang")
                return

    async def serve_http(
        self, handler_engine: SimEngine, *, task_status: trio.TaskStatus[list[trio.SocketListener]]
    ) -> None:
        async def handler(stream: trio.SocketStream) -> None:
            await serve_connection(stream, handler_engine.handle)

        await trio.serve_tcp(handler, self.args.port, host=self.args.host, task_status=task_status)

    async def main(self, nursery: trio.Nursery) -> None:
        args = self.args
        if args.is_gang and args.node_rank > 0:
            nursery.start_soon(self.member)
            if args.shape == "sglang":
                # SGLang's other ranks run a dummy health server that always says 200.
                try:
                    await nursery.start(self.serve_http, _DummyHealth(args))
                except OSError as exc:
                    log.warning("dummy health server not started: %s", exc)
            return
        if args.is_gang:
            lost_send, lost_recv = trio.open_memory_channel[int](16)
            await nursery.start(serve_rendezvous, args, lost_send)
            nursery.start_soon(self.watch_gang, lost_recv)
        if not args.serves_api:
            log.info("headless: no API server")
            return
        if args.load_seconds > 0:
            log.info(
                "simulating model load for %gs (port %d not listening)",
                args.load_seconds,
                args.port,
            )
            await trio.sleep(args.load_seconds)
        await nursery.start(self.serve_http, self.engine)
        log.info(
            "ready: serving %s on http://%s:%d", ",".join(args.served_names), args.host, args.port
        )


class _DummyHealth(SimEngine):
    async def handle(self, ex: Exchange) -> None:
        if ex.path == "/health":
            await ex.send_bytes(200, "text/plain", b"")
        else:
            await ex.send_json(404, {"error": {"message": "not rank 0", "code": 404}})


async def run(args: SimArgs) -> int:
    """Run the simulated engine until a signal, a simulated crash or a broken gang."""
    async with trio.open_nursery() as nursery:
        state = _Run(args, nursery.cancel_scope)
        nursery.start_soon(state.signals)
        if args.exit_after is not None:
            nursery.start_soon(state.crash_later, args.exit_after)
        try:
            await state.main(nursery)
        except OSError as exc:
            state.finish(1, f"cannot listen: {exc}")
    return state.code


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format="%(asctime)s %(levelname)s simengine[%(process)d]: %(message)s",
    )
    log.info("SIMULATED engine (llmgw.simengine): no model, no GPU; made-up tokens")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv, os.environ if env is None else env)
    except UsageError as exc:
        log.error("%s (argv: %s)", exc, " ".join(argv))
        return 2
    if args.unknown:
        log.info("ignoring flags the simulation does not use: %s", " ".join(args.unknown))
    # Opt-in (LLMGW_SIM_READ_WEIGHTS=1): the suite's fake model trees hold placeholder
    # shards that only the storage scan's rules need, which no loader could read.
    env_now = os.environ if env is None else env
    broken = check_weights(args.model) if env_now.get(READ_WEIGHTS_ENV) == "1" else ""
    if broken:  # as vLLM's loader dies on a copy it cannot read
        log.error("cannot load the model at %s: %s", args.model, broken)
        return 1
    log.info(
        "%s shape: model=%s served=%s host=%s port=%d tp=%d nnodes=%d rank=%d%s",
        args.shape,
        args.model,
        ",".join(args.served_names),
        args.host,
        args.port,
        args.tensor_parallel,
        args.nnodes,
        args.node_rank,
        f" rendezvous={args.rendezvous_host}:{args.rendezvous_port}" if args.is_gang else "",
    )
    return trio.run(partial(run, args))
