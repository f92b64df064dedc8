"""Control-plane figures: N simulated agents (real CURVE DEALER sockets, several hundred
per worker process) against one `llmgw server` process.

Prints, per N: the server's CPU per heartbeat, its resident memory per node,
heartbeat-to-acknowledgement latency p50/p99 as the agents see it, the agents' workers' own
CPU (apart from the server's), and a storm: the server SIGKILLed and restarted on the same
state, every agent reconnecting as the real one does (a new socket after jittered
backoff), timed from the restarted server listening to all agents welcomed back.

    .venv/bin/python bench/control_plane.py                  # N = 1,000 and 10,000
    .venv/bin/python bench/control_plane.py --nodes 2000 --window 20 --json cp.json

A figure, not a test: nothing here asserts. On a 2-core machine the agents' workers and
the server share the cores, so latency includes the workers' own scheduling.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name: the Python (trio) thread vs libzmq's I/O threads."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        key = "python" if tid == str(pid) else ("zmq-io" if name.startswith("ZMQbg") else "other")
        out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# ---- worker: many lightweight agents in one trio process ----
#
# The driver and the workers meet in a folder: each worker writes how many of its agents
# are welcomed to `progress-I`; the driver measures once all are, then writes `window`
# (two wall-clock times) and `stop`. Every wait is bounded.

MAX_RUN = 600.0  # no worker outlives this


async def _worker(server: str, server_key: str, secrets: list[str], interval: float,
                  meet: Path, index: int) -> dict[str, Any]:
    import trio
    import zmq

    from llmgw import PROTOCOL_VERSION
    from llmgw.backoff import backoff_delay
    from llmgw.model.inventory import Inventory, NodeInfo
    from llmgw.transport import codec
    from llmgw.transport.dealer import connect
    from llmgw.transport.keys import load_pair, load_public
    from llmgw.transport.messages import Heartbeat, HeartbeatAck, Hello, HelloFirst, Welcome

    ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
    ctx.set(zmq.MAX_SOCKETS, 65536)  # the default, 1023, is below one worker's share
    server_public = load_public(server_key)
    samples: list[tuple[float, float]] = []  # (wall time sent, latency)
    welcomed = 0
    stop = meet / "stop"

    rewelcomed = 0
    storm = meet / "storm"

    async def handshake(conn: Any, hello: bytes) -> bool:
        await conn.send(hello)
        # The real agent's bound on a Hello's answer, then a new socket (agent/link.py).
        with trio.move_on_after(max(3 * interval, 1.0)):
            while not isinstance(codec.decode(await conn.recv()), Welcome):
                pass
            return True
        return False

    async def beat(conn: Any) -> bool:
        """Heartbeats every interval, as the real agent's link sends them (not waiting for
        acks), until the server forgets us (HelloFirst: it restarted; True) or is silent
        for three intervals (False)."""
        pending: dict[int, tuple[float, float]] = {}  # seq -> (sent, wall time sent)

        async def sender(cancel: trio.CancelScope) -> None:
            seq = 0
            while not stop.exists():
                seq += 1
                pending[seq] = (trio.current_time(), time.time())
                await conn.send(codec.encode(Heartbeat(seq)))
                await trio.sleep(interval)
            cancel.cancel()

        forgotten = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender, nursery.cancel_scope)
            while True:
                with trio.move_on_after(3 * interval) as silent:
                    msg = codec.decode(await conn.recv())
                if silent.cancelled_caught:
                    break
                if isinstance(msg, HelloFirst):
                    forgotten = True
                    break
                if isinstance(msg, HeartbeatAck) and msg.seq in pending:
                    sent, wall = pending.pop(msg.seq)
                    samples.append((wall, trio.current_time() - sent))
            nursery.cancel_scope.cancel()
        return forgotten

    async def agent(secret: str) -> None:
        nonlocal welcomed, rewelcomed
        pair = load_pair(secret)
        hello = codec.encode(Hello(PROTOCOL_VERSION, NodeInfo(pair.identity, "127.0.0.1"), Inventory()))
        attempt = 0
        first, back = True, False
        while not stop.exists():
            async with connect(ctx, server, pair, server_public) as conn:
                while await handshake(conn, hello):
                    attempt = 0
                    if first:
                        welcomed += 1
                        first = False
                        await trio.sleep(random.random() * interval)
                    elif not back and storm.exists():
                        rewelcomed += 1
                        back = True
                    if not await beat(conn) or stop.exists():
                        break
                    # HelloFirst: Hello again on the same connection after the real
                    # agent's jittered backoff (agent/link.py).
                    await trio.sleep(backoff_delay(attempt, 1.0, 30.0, random.random()))
                    attempt += 1
            if stop.exists():
                break
            # The real agent's reconnect: a new socket (a new CURVE handshake) after
            # jittered exponential backoff, from the agent's own defaults.
            await trio.sleep(backoff_delay(attempt, 1.0, 30.0, random.random()))
            attempt += 1

    async def progress() -> None:
        while True:
            (meet / f"progress-{index}").write_text(f"{welcomed} {rewelcomed}")
            await trio.sleep(1.0)

    with trio.move_on_after(MAX_RUN):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(progress)
            async with trio.open_nursery() as agents:
                for s in secrets:
                    agents.start_soon(agent, s)
            nursery.cancel_scope.cancel()
    ctx.destroy(linger=0)
    window = meet / "window"
    t0, t1 = (float(x) for x in window.read_text().split()) if window.exists() else (0.0, 0.0)
    lat = [d for w, d in samples if t0 <= w < t1]
    return {"latencies": lat, "acks": len(lat), "welcomed": welcomed, "rewelcomed": rewelcomed}


def worker_main(args: argparse.Namespace) -> None:
    import trio

    _raise_fd_limit()
    secrets = Path(args.secrets).read_text().split()
    result = trio.run(_worker, args.server, args.server_key, secrets, args.interval,
                      Path(args.meet), args.index)
    print(json.dumps(result))


# ---- driver ----


def _welcomed(meet: Path, column: int = 0) -> int:
    """Agents welcomed (column 0) or welcomed again after the storm began (column 1)."""
    total = 0
    for f in meet.glob("progress-*"):
        try:
            total += int((f.read_text() or "0 0").split()[column])
        except (OSError, ValueError, IndexError):
            continue  # being written this instant
    return total


def _start_server(root: Path, config: Path, log_name: str,
                  ready: bytes = b"listening on", llmgw: list[str] | None = None) -> subprocess.Popen[bytes]:
    """`llmgw server` as its own process, once its log says `ready` (a standby of several
    servers says "standby on"). `llmgw`: the command to run instead of `python -m llmgw.cli`
    (failover.py's frozen leader: tests/fakes/frozen_server.py)."""
    log_path = root / log_name
    llmgw = llmgw or [sys.executable, "-m", "llmgw.cli"]
    with open(log_path, "wb") as log:
        server = subprocess.Popen([*llmgw, "server", "--config", str(config)],
                                  stdout=log, stderr=subprocess.STDOUT, preexec_fn=_raise_fd_limit)
    t0 = time.monotonic()
    while ready not in log_path.read_bytes():
        if server.poll() is not None or time.monotonic() - t0 > 120:
            raise SystemExit(f"the server did not start: {log_path.read_text()[-2000:]}")
        time.sleep(0.05)
    return server


def _stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.kill()
    p.wait(30)


def run(n: int, interval: float, window: float, per_worker: int, storm: bool) -> dict[str, float]:
    from llmgw.transport import keys

    sys.path.insert(0, str(HERE.parent / "tests"))
    from fakes.engines import free_port  # type: ignore[import-not-found]

    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        root = Path(tmp)
        meet = root / "meet"
        meet.mkdir()
        kd = root / "keys"
        keys.init_keys(str(kd))
        t0 = time.monotonic()
        names = [f"n{i:05d}" for i in range(n)]
        for name in names:
            keys.issue_key(str(kd), "node", name)
        print(f"  issued {n} keys in {time.monotonic() - t0:.1f}s", file=sys.stderr)
        address = f"tcp://127.0.0.1:{free_port()}"
        config = root / "server.toml"
        config.write_text(
            f'bind = "{address}"\nkeys_dir = "{kd}"\nstate_dir = "{root / "state"}"\n'
            f'heartbeat_interval = "{interval}s"\nmetrics_bind = ""\n')
        server = _start_server(root, config, "server.log")
        workers: list[subprocess.Popen[bytes]] = []
        storm_s = storm_cpu = startup_cpu = float("nan")
        storm_threads: dict[str, float] = {}
        try:
            rss_idle = _rss_bytes(server.pid)
            chunks = [names[i:i + per_worker] for i in range(0, n, per_worker)]
            for i, chunk in enumerate(chunks):
                sf = root / f"secrets-{i}"
                sf.write_text("\n".join(str(kd / f"{nm}.key_secret") for nm in chunk))
                workers.append(subprocess.Popen(
                    [sys.executable, __file__, "--worker", "--server", address, "--server-key",
                     str(kd / "server.key"), "--secrets", str(sf), "--interval", str(interval),
                     "--meet", str(meet), "--index", str(i)],
                    stdout=subprocess.PIPE))
            t0 = time.monotonic()
            while _welcomed(meet) < n and time.monotonic() - t0 < 300:
                time.sleep(0.5)
            print(f"  {_welcomed(meet)} of {n} connected in {time.monotonic() - t0:.0f}s",
                  file=sys.stderr)
            time.sleep(interval)  # every agent into its heartbeat rhythm
            wall0, cpu0, threads0 = time.time(), _cpu_seconds(server.pid), _thread_cpu(server.pid)
            agents0 = sum(_cpu_seconds(w.pid) for w in workers)
            profiler = None
            if os.environ.get("LLMGW_BENCH_PROFILE"):
                profiler = subprocess.Popen(["py-spy", "record", "-r", "1000", "-p", str(server.pid), "-d",
                                             str(int(window)), "-f", "raw", "-o",
                                             os.environ["LLMGW_BENCH_PROFILE"]],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(window)
            wall1, cpu1, threads1 = time.time(), _cpu_seconds(server.pid), _thread_cpu(server.pid)
            agents1 = sum(_cpu_seconds(w.pid) for w in workers)
            rss = _rss_bytes(server.pid)
            if profiler is not None:
                profiler.wait(60)
            (meet / "window").write_text(f"{wall0} {wall1}")
            if storm:
                # A server restart: SIGKILL, the same config and state, every agent back.
                _stop(server)
                (meet / "storm").write_text(str(time.time()))
                server = _start_server(root, config, "server-restarted.log")
                t_listen = time.monotonic()
                startup_cpu = _cpu_seconds(server.pid)
                storm_threads0 = _thread_cpu(server.pid)
                if os.environ.get("LLMGW_BENCH_STORM_PROFILE"):
                    profiler = subprocess.Popen(["py-spy", "record", "-r", "1000", "-p", str(server.pid),
                                                 "-f", "raw", "-o", os.environ["LLMGW_BENCH_STORM_PROFILE"]],
                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                while _welcomed(meet, 1) < n and time.monotonic() - t_listen < 300:
                    time.sleep(0.05)
                storm_s = time.monotonic() - t_listen
                storm_cpu = _cpu_seconds(server.pid) - startup_cpu
                storm_threads = {k: v - storm_threads0.get(k, 0.0)
                                 for k, v in _thread_cpu(server.pid).items()}
                if profiler is not None and os.environ.get("LLMGW_BENCH_STORM_PROFILE"):
                    profiler.send_signal(signal.SIGINT)  # py-spy writes what it has on SIGINT
                    profiler.wait(60)
                split = ", ".join(f"{k} {v:.1f}s" for k, v in sorted(storm_threads.items()))
                print(f"  storm: {_welcomed(meet, 1)} of {n} back in {storm_s:.1f}s "
                      f"(server CPU {storm_cpu:.1f}s: {split}; {startup_cpu:.1f}s more to start)",
                      file=sys.stderr)
            (meet / "stop").touch()
            results = [json.loads(w.communicate(timeout=120)[0]) for w in workers]
        finally:
            (meet / "stop").touch()
            for w in workers:
                _stop(w)
            _stop(server)
    lat = sorted(x for r in results for x in r["latencies"])
    acks = sum(r["acks"] for r in results)
    welcomed = sum(r["welcomed"] for r in results)
    spent = cpu1 - cpu0
    return {
        "nodes": n,
        "welcomed": welcomed,
        "heartbeats": acks,
        "server_cpu_ms_per_heartbeat": spent / max(acks, 1) * 1000,
        "server_core_share": spent / window,
        "python_share": (threads1.get("python", 0) - threads0.get("python", 0)) / max(spent, 1e-9),
        "agents_core_share": (agents1 - agents0) / window,
        "server_rss_kib_per_node": (rss - rss_idle) / max(welcomed, 1) / 1024,
        "ack_p50_ms": statistics.median(lat) * 1000 if lat else float("nan"),
        "ack_p99_ms": lat[int(len(lat) * 0.99)] * 1000 if lat else float("nan"),
        "storm_s": storm_s,
        "storm_server_cpu_s": storm_cpu,
        "storm_server_cpu_ms_per_reconnect": storm_cpu / n * 1000,
        "server_start_cpu_s": startup_cpu,
        "storm_server_cpu_by_thread_s": storm_threads,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, action="append", help="N (repeatable); default 1000 and 10000")
    p.add_argument("--interval", type=float, default=5.0, help="heartbeat interval, seconds")
    p.add_argument("--window", type=float, default=20.0, help="measured seconds")
    p.add_argument("--per-worker", type=int, default=1000, help="agents per worker process")
    p.add_argument("--no-storm", action="store_true", help="skip the server-restart storm")
    p.add_argument("--json", metavar="FILE", help="also write the figures as one JSON object "
                   "(keyed by N when several N are run)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--server", help=argparse.SUPPRESS)
    p.add_argument("--server-key", help=argparse.SUPPRESS)
    p.add_argument("--secrets", help=argparse.SUPPRESS)
    p.add_argument("--meet", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker_main(args)
        return
    _raise_fd_limit()
    print(f"{'nodes':>7} {'ready':>7} {'heartbeats':>10} {'CPU/hb':>9} {'core':>6} {'python':>7} "
          f"{'agents':>7} {'RSS/node':>9} {'p50':>8} {'p99':>8} {'storm':>7} {'storm CPU':>10}")
    runs = []
    for n in args.nodes or [1000, 10000]:
        r = run(n, args.interval, args.window, args.per_worker, not args.no_storm)
        runs.append(r)
        print(f"{r['nodes']:>7} {r['welcomed']:>7} {r['heartbeats']:>10} "
              f"{r['server_cpu_ms_per_heartbeat']:>7.3f}ms {r['server_core_share']:>5.0%} "
              f"{r['python_share']:>6.0%} {r['agents_core_share']:>6.0%} "
              f"{r['server_rss_kib_per_node']:>6.1f}KiB {r['ack_p50_ms']:>6.2f}ms {r['ack_p99_ms']:>6.2f}ms "
              f"{r['storm_s']:>6.1f}s {r['storm_server_cpu_s']:>9.1f}s", flush=True)
    if args.json:
        doc = runs[0] if len(runs) == 1 else {str(r["nodes"]): r for r in runs}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
