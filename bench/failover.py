"""Failover figures (issue 14): two `llmgw server` processes on one PostgreSQL database and
N simulated agents that follow the leader as the real agent does; the leader is SIGKILLed
and the bench times how long until a standby leads and until every agent is welcomed by it.

    .venv/bin/python bench/failover.py                        # 1,000 agents, 10 s lease, 5 s heartbeat
    .venv/bin/python bench/failover.py --nodes 1000 --lease 3 --interval 1 --json fo.json

PostgreSQL is Debian's (tests/fakes/postgres.py starts a throwaway cluster; as root it runs
as the `postgres` user). Each simulated agent is a real CURVE DEALER socket that behaves
as agent/link.py does: Hello answered within 3 heartbeat intervals (given up at once where
connects are refused) or a new socket; a
standby's NotLeader sends it to the leader named (transport/follow.py's Follower, the same
class the agent uses); three silent intervals or HelloFirst end a session; reconnects
after the agent's jittered backoff (1 s base, 30 s cap).

Printed: `lead_s` (SIGKILL → the standby's log says it leads), `all_back_s` (SIGKILL →
every agent welcomed by the new leader), and the parts of the latter: the lease wait and
the agents' own silence detection (3 intervals) plus backoff. A figure, not a test.

    .venv/bin/python bench/failover.py --fault frozen --nodes 200 --lease 3 --interval 1
    .venv/bin/python bench/failover.py --storm 600          # issue 19's 10 minutes, 10 s lease

`--fault frozen` (issue 19): instead of a SIGKILL the leader stops itself (SIGSTOP, the
store's test hook) inside the write transaction of an apply it is answering, holding the
transaction open with its connections up; the times count from the moment it stopped.
`--storm S`: no servers; the lease keeper and fenced store as ha.py runs them hold the
lease for S seconds while 80 writers keep every store thread busy with 30 ms
transactions (tests/integration/test_frozen_leader_storm.py for S seconds): the lease is
never lost, or the bench says when and why.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MAX_RUN = 600.0  # no worker outlives this
LEADING = re.compile(rb"leading with epoch (\d+)")


async def _worker(servers: list[str], server_key: str, secrets: list[str], interval: float,
                  meet: Path, index: int) -> dict[str, Any]:
    import trio
    import zmq

    from llmgw import PROTOCOL_VERSION
    from llmgw.backoff import backoff_delay
    from llmgw.model.inventory import Inventory, NodeInfo
    from llmgw.transport import codec
    from llmgw.transport.dealer import connect
    from llmgw.transport.follow import Follower
    from llmgw.transport.keys import load_pair, load_public
    from llmgw.transport.messages import Heartbeat, Hello, HelloFirst, NotLeader, Welcome

    ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
    ctx.set(zmq.MAX_SOCKETS, 65536)
    server_public = load_public(server_key)
    stop, killed = meet / "stop", meet / "killed"
    welcomed_by: dict[str, str] = {}  # identity -> the address that last welcomed it

    async def handshake(conn: Any, hello: bytes, follower: Follower) -> bool:
        async def hello_answered() -> bool:
            # With no connection up, the send itself waits: it shares the bound (as in link.py).
            await conn.send(hello)
            while True:
                msg = codec.decode(await conn.recv())
                if isinstance(msg, Welcome):
                    follower.connected()
                    return True
                if isinstance(msg, NotLeader):
                    follower.redirected(msg.leader)
                    return False

        answer = False
        with trio.move_on_after(max(3 * interval, 1.0)):
            async with trio.open_nursery() as nursery:
                async def nothing_listens() -> None:  # as link.py: give up where connects are refused
                    await conn.monitor.until_nothing_listens()
                    nursery.cancel_scope.cancel()
                nursery.start_soon(nothing_listens)
                answer = await hello_answered()
                nursery.cancel_scope.cancel()
        return answer

    async def beat(conn: Any, follower: Follower) -> None:
        async def sender() -> None:
            seq = 0
            while True:
                seq += 1
                await conn.send(codec.encode(Heartbeat(seq)))
                await trio.sleep(interval)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender)
            while not stop.exists():
                with trio.move_on_after(3 * interval) as silent:
                    msg = codec.decode(await conn.recv())
                if silent.cancelled_caught or isinstance(msg, HelloFirst):
                    break
                if isinstance(msg, NotLeader):
                    follower.redirected(msg.leader)
                    break
            nursery.cancel_scope.cancel()

    async def agent(secret: str) -> None:
        pair = load_pair(secret)
        follower = Follower(servers)
        hello = codec.encode(Hello(PROTOCOL_VERSION, NodeInfo(pair.identity, "127.0.0.1"), Inventory()))
        attempt = 0
        while not stop.exists():
            address = follower.pick()
            async with connect(ctx, address, pair, server_public) as conn:
                if await handshake(conn, hello, follower):
                    attempt = 0
                    welcomed_by[pair.identity] = address
                    await beat(conn, follower)
            if stop.exists():
                break
            await trio.sleep(backoff_delay(attempt, 1.0, 30.0, random.random()))
            attempt += 1

    async def progress() -> None:
        while True:
            counts: dict[str, int] = {}
            for address in welcomed_by.values():
                counts[address] = counts.get(address, 0) + 1
            (meet / f"progress-{index}.json").write_text(json.dumps(counts))
            await trio.sleep(0.1 if killed.exists() else 0.5)

    with trio.move_on_after(MAX_RUN):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(progress)
            async with trio.open_nursery() as agents:
                for s in secrets:
                    agents.start_soon(agent, s)
            nursery.cancel_scope.cancel()
    ctx.destroy(linger=0)
    return {"agents": len(secrets)}


def worker_main(args: argparse.Namespace) -> None:
    import trio
    from control_plane import _raise_fd_limit  # type: ignore[import-not-found]

    _raise_fd_limit()
    secrets = Path(args.secrets).read_text().split()
    print(json.dumps(trio.run(_worker, args.servers.split(","), args.server_key, secrets,
                              args.interval, Path(args.meet), args.index)))


def _welcomed_by(meet: Path) -> dict[str, int]:
    total: dict[str, int] = {}
    for f in meet.glob("progress-*.json"):
        try:
            counts = json.loads(f.read_text() or "{}")
        except (OSError, ValueError):
            continue  # being written this instant
        for address, count in counts.items():
            total[address] = total.get(address, 0) + count
    return total


def _leads(log: Path) -> bool:
    return LEADING.search(log.read_bytes()) is not None


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def _apply_in_background(address: str, admin_key: str, server_key: str) -> None:
    import threading

    import trio

    from llmgw.model.deployment import Deployment
    from llmgw.transport.client import request
    from llmgw.transport.requests import ApplyOp

    op = ApplyOp(Deployment(name="frozen-write", model="org/frozen", engine="simulated",
                            gpus_per_node=1, replicas=1))

    def send() -> None:
        try:
            trio.run(request, address, admin_key, server_key, op, 60.0)
        except Exception as exc:  # the point is the freeze; the answer is only reported
            print(f"  the frozen leader's apply: {type(exc).__name__}: {exc}", file=sys.stderr)

    threading.Thread(target=send, daemon=True).start()


def run(n: int, lease: float, interval: float, per_worker: int, fault: str = "sigkill") -> dict[str, Any]:
    sys.path.insert(0, str(HERE.parent / "tests"))
    from control_plane import _raise_fd_limit, _start_server, _stop  # type: ignore[import-not-found]

    from fakes.engines import free_port  # type: ignore[import-not-found]
    from fakes.postgres import PgServer, pg_bin  # type: ignore[import-not-found]
    from llmgw.transport import keys

    bin_dir = pg_bin()
    if bin_dir is None:
        raise SystemExit("needs PostgreSQL's server programs: apt-get install postgresql")
    pg = PgServer(bin_dir)  # initdb and start
    with tempfile.TemporaryDirectory(prefix="llmgw-failover-") as tmp:
        root = Path(tmp)
        meet = root / "meet"
        meet.mkdir()
        kd = root / "keys"
        keys.init_keys(str(kd))
        names = [f"n{i:05d}" for i in range(n)]
        for name in names:
            keys.issue_key(str(kd), "node", name)
        keys.issue_key(str(kd), "admin", "ops")
        url = pg.new_database()
        addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        configs = []
        for i, address in enumerate(addresses):
            config = root / f"server-{i}.toml"
            config.write_text(
                f'bind = "{address}"\nkeys_dir = "{kd}"\nstate_dir = "{root / f"state-{i}"}"\n'
                f'heartbeat_interval = "{interval}s"\nmetrics_bind = ""\n'
                f'[store]\nurl = "{url}"\nlease = "{lease}s"\n')
            config.chmod(0o600)
            configs.append(config)
        servers: list[subprocess.Popen[bytes]] = []
        workers: list[subprocess.Popen[bytes]] = []
        try:
            # The first leads (it starts alone and wins the empty lease); the second waits.
            freeze = root / "freeze"  # armed only when the file is written
            frozen = [sys.executable, str(HERE.parent / "tests" / "fakes" / "frozen_server.py"), str(freeze)]
            servers.append(_start_server(root, configs[0], "server-0.log", b"standby on", frozen))
            t0 = time.monotonic()
            while not _leads(root / "server-0.log") and time.monotonic() - t0 < 60:
                time.sleep(0.05)
            servers.append(_start_server(root, configs[1], "server-1.log", b"standby on"))
            for i in range(0, n, per_worker):
                sf = root / f"secrets-{i}"
                sf.write_text("\n".join(str(kd / f"{nm}.key_secret") for nm in names[i:i + per_worker]))
                workers.append(subprocess.Popen(
                    [sys.executable, __file__, "--worker", "--servers", ",".join(addresses),
                     "--server-key", str(kd / "server.key"), "--secrets", str(sf),
                     "--interval", str(interval), "--meet", str(meet), "--index", str(i)],
                    stdout=subprocess.PIPE, preexec_fn=_raise_fd_limit))
            t0 = time.monotonic()
            while _welcomed_by(meet).get(addresses[0], 0) < n and time.monotonic() - t0 < 300:
                time.sleep(0.2)
            connected = _welcomed_by(meet).get(addresses[0], 0)
            print(f"  {connected} of {n} agents with the leader in {time.monotonic() - t0:.0f}s",
                  file=sys.stderr)
            time.sleep(2 * interval)  # every agent into its heartbeat rhythm
            if fault == "frozen":
                freeze.write_text("INSERT INTO deployments")
                _apply_in_background(addresses[0], str(kd / "ops.key_secret"), str(kd / "server.key"))
                t0 = time.monotonic()
                while not _stopped(servers[0].pid) and time.monotonic() - t0 < 30:
                    time.sleep(0.01)
                if not _stopped(servers[0].pid):
                    raise SystemExit("the leader did not stop inside its write")
            else:
                servers[0].kill()
            t_kill = time.monotonic()
            (meet / "killed").touch()
            lead_s = all_back_s = float("nan")
            while time.monotonic() - t_kill < 120:
                now = time.monotonic() - t_kill
                if lead_s != lead_s and _leads(root / "server-1.log"):
                    lead_s = now
                if _welcomed_by(meet).get(addresses[1], 0) >= connected:
                    all_back_s = now
                    break
                time.sleep(0.05)
            back = _welcomed_by(meet).get(addresses[1], 0)
            print(f"  leader {'frozen inside a write' if fault == 'frozen' else 'SIGKILLed'}: the "
                  f"standby led after {lead_s:.2f}s, {back} of {connected} agents with it after "
                  f"{all_back_s:.2f}s", file=sys.stderr)
            if fault == "frozen":
                os.kill(servers[0].pid, signal.SIGCONT)
            (meet / "stop").touch()
            for w in workers:
                w.communicate(timeout=60)
        finally:
            (meet / "stop").touch()
            for p in [*workers, *servers]:
                _stop(p)
            pg.close()
    return {"nodes": n, "lease_s": lease, "heartbeat_s": interval, "fault": fault, "lead_s": lead_s,
            "all_back_s": all_back_s, "agents_back": back}


def storm(seconds: float, lease: float) -> dict[str, Any]:
    sys.path.insert(0, str(HERE.parent / "tests"))
    sys.path.insert(0, str(HERE.parent / "tests" / "integration"))
    import trio
    from test_frozen_leader_storm import storm as hold_under_storm  # type: ignore[import-not-found]

    from fakes.postgres import PgServer, pg_bin  # type: ignore[import-not-found]

    bin_dir = pg_bin()
    if bin_dir is None:
        raise SystemExit("needs PostgreSQL's server programs: apt-get install postgresql")
    pg = PgServer(bin_dir)
    try:
        why, written = trio.run(hold_under_storm, pg.new_database(), seconds, lease)
    finally:
        pg.close()
    return {"storm_s": seconds, "lease_s": lease, "writes": written, "lost": why}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1000, help="simulated agents")
    p.add_argument("--lease", type=float, default=10.0, help="the servers' lease, seconds")
    p.add_argument("--interval", type=float, default=5.0, help="heartbeat interval, seconds")
    p.add_argument("--per-worker", type=int, default=500, help="agents per worker process")
    p.add_argument("--fault", choices=("sigkill", "frozen"), default="sigkill",
                   help="kill the leader, or freeze it inside a write transaction")
    p.add_argument("--storm", type=float, metavar="SECONDS",
                   help="only hold the lease under a write storm this long (no servers)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as one JSON object")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--servers", help=argparse.SUPPRESS)
    p.add_argument("--server-key", help=argparse.SUPPRESS)
    p.add_argument("--secrets", help=argparse.SUPPRESS)
    p.add_argument("--meet", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, str(HERE))
    if args.worker:
        worker_main(args)
        return
    # A SIGTERM (timeout, Ctrl-C's cousin) unwinds through run's cleanup: servers, workers
    # and PostgreSQL are stopped by pid, none left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.storm is not None:
        r: dict[str, Any] = storm(args.storm, args.lease)
        print(f"write storm: {r['writes']} writes in {r['storm_s']:g}s under a {r['lease_s']:g}s lease; "
              f"lease lost: {r['lost'] or 'never'}")
        if args.json:
            Path(args.json).write_text(json.dumps(r, indent=1) + "\n")
        return
    r = run(args.nodes, args.lease, args.interval, args.per_worker, args.fault)
    print(f"{'agents':>7} {'lease':>6} {'heartbeat':>9} {'fault':>8} {'standby leads':>14} {'all agents back':>16}")
    print(f"{r['nodes']:>7} {r['lease_s']:>5g}s {r['heartbeat_s']:>8g}s {r['fault']:>8} {r['lead_s']:>13.2f}s "
          f"{r['all_back_s']:>15.2f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
