"""Multi-node gangs, simulated: rank 0 holds a rendezvous port that every other rank
connects to, like torch.distributed's store. Rank 0 serves only once the gang is whole;
another rank exits when its connection to rank 0 closes; rank 0's engine is dead
(health 503) when a member's connection closes."""

from __future__ import annotations

import logging

import trio

from llmgw.simengine.args import SimArgs

log = logging.getLogger("llmgw.simengine")

RETRY_INTERVAL = 0.2


class GangBroken(Exception):
    """This member lost the gang; the engine must exit with code 1."""


async def _read_line(stream: trio.SocketStream, limit: int = 256) -> bytes:
    buf = b""
    while b"\n" not in buf and len(buf) < limit:
        data = await stream.receive_some(limit)
        if not data:
            break
        buf += data
    return buf.split(b"\n", 1)[0]


async def _member(
    stream: trio.SocketStream,
    args: SimArgs,
    members: dict[int, trio.SocketStream],
    whole: trio.Event,
    on_lost: list[int],
) -> None:
    rank = -1
    try:
        with trio.move_on_after(10):
            line = await _read_line(stream)
            parts = line.split()
            if len(parts) == 2 and parts[0] == b"rank" and parts[1].isdigit():
                rank = int(parts[1])
        if not 0 < rank < args.nnodes or rank in members:
            log.warning("rendezvous: refused a connection announcing %r", rank)
            return
        members[rank] = stream
        log.info("rendezvous: rank %d joined (%d of %d)", rank, len(members) + 1, args.nnodes)
        if len(members) == args.nnodes - 1:
            whole.set()
        await stream.send_all(b"ok\n")
        while await stream.receive_some(256):
            pass
        log.warning("rendezvous: rank %d disconnected", rank)
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        log.warning("rendezvous: rank %d connection broke: %r", rank, exc)
    finally:
        if members.get(rank) is stream:
            del members[rank]
            if whole.is_set():
                on_lost.append(rank)
        with trio.CancelScope(shield=True):
            await stream.aclose()


async def serve_rendezvous(
    args: SimArgs,
    on_member_lost: trio.MemorySendChannel[int],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Rank 0: listen on the rendezvous port; report started once every rank joined.

    After that, every rank whose connection closes is sent on `on_member_lost`.
    """
    listeners = await trio.open_tcp_listeners(args.rendezvous_port, host=args.rendezvous_host)
    log.info(
        "rendezvous: rank 0 listening on %s:%d, waiting for %d other rank(s)",
        args.rendezvous_host,
        args.rendezvous_port,
        args.nnodes - 1,
    )
    members: dict[int, trio.SocketStream] = {}
    whole = trio.Event()
    lost: list[int] = []

    async def handler(stream: trio.SocketStream) -> None:
        await _member(stream, args, members, whole, lost)
        for rank in lost:
            await on_member_lost.send(rank)
        lost.clear()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, handler, listeners)
        await whole.wait()
        log.info("rendezvous: gang complete (%d ranks)", args.nnodes)
        task_status.started()


async def join_gang(
    args: SimArgs, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Rank > 0: connect to rank 0 (retrying until it listens), then hold the connection.

    Raises GangBroken when rank 0 goes away.
    """
    where = f"{args.rendezvous_host}:{args.rendezvous_port}"
    attempts = 0
    while True:
        try:
            stream = await trio.open_tcp_stream(args.rendezvous_host, args.rendezvous_port)
            break
        except OSError as exc:
            attempts += 1
            if attempts == 1 or attempts % 50 == 0:
                log.info("rendezvous: rank 0 at %s not reachable yet (%s); retrying", where, exc)
            await trio.sleep(RETRY_INTERVAL)
    async with stream:
        try:
            await stream.send_all(f"rank {args.node_rank}\n".encode())
            reply = await _read_line(stream)
            if reply != b"ok":
                raise GangBroken(f"rank 0 at {where} refused rank {args.node_rank}")
            log.info("rendezvous: rank %d joined the gang at %s", args.node_rank, where)
            task_status.started()
            while await stream.receive_some(256):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.debug("rendezvous connection error: %r", exc)
    raise GangBroken(f"connection to rank 0 at {where} closed")
