"""Router benchmark: figures printed, not a timed test.

    .venv/bin/python bench/router.py [--engine sim|stub] [--seconds 3] [--repeat 5]

Starts two engines (the simulated engine, or a minimal stub), the llmgw router as its own
process in front of them, and a load generator in this process. For chat completions
non-streamed and streamed (32 events), at concurrency 1 and 64, directly to one engine
and through the router, it prints requests/s, latency p50/p99 (time to first event for
streams), the latency the router adds, events/s relayed, and the router's CPU seconds
per request: utime+stime of the router process over the window / requests served.
Peers (vllm-router, sglang-router, LiteLLM) are measured when installed, skipped with a
line otherwise.

    .venv/bin/python bench/router.py --burst 5000 [--replicas 4] [--tokens 32]

    .venv/bin/python bench/router.py --keys [--seconds 3] [--repeat 5]

Keys mode (issue 24): two routers, keys off and keys on (a key table with one key, rpm
and tpm limits spent from leases an in-process LimitBooks grants, a concurrency limit
(KEY_CONCURRENCY, above the bench's 64 at once: never refuses) run on slots it leases and
the router renews, usage metered and sent to a sink that drops it), measured interleaved
cell by cell; every request carries the key (ignored where keys are off). Prints each cell
and the CPU ratio on/off.

Burst mode (issue 20): N keep-alive connections opened first, then one streamed chat sent
on each at the same moment. Prints completed streams, clean refusals (503/429, with
Retry-After), errors by kind, time to first byte p50/p99 (from the common send), and the
router's peak RSS and open descriptors (sampled every 50 ms) and its log's ejections.
`--src DIR` runs the router from another source tree (a `git archive` of an older commit)
for before/after figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
import trio.lowlevel

ROOT = Path(__file__).resolve().parents[1]
EVENTS = 32
TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- a minimal engine stub (--engine stub) ----------------------------------------------

CHAT = json.dumps(
    {
        "id": "x",
        "object": "chat.completion",
        "model": "sim",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
    }
).encode()
EVENT = b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"delta":{"content":"w"}}]}\n\n'


async def stub_conn(stream: trio.SocketStream) -> None:
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = b""
    try:
        while True:
            while b"\r\n\r\n" not in buf:
                data = await stream.receive_some(65536)
                if not data:
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                k, _, v = line.partition(b":")
                if k.strip().lower() == b"content-length":
                    length = int(v)
            while len(buf) < length:
                buf += await stream.receive_some(65536)
            body, buf = buf[:length], buf[length:]
            if b'"stream": true' in body or b'"stream":true' in body:
                await stream.send_all(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                chunk = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)
                for _ in range(EVENTS):
                    await stream.send_all(chunk)
                done = b"data: [DONE]\n\n"
                await stream.send_all(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
            else:
                await stream.send_all(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(CHAT), CHAT)
                )
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return


def run_stub(port: int) -> None:
    trio.run(trio.serve_tcp, stub_conn, port)


# ---- the router under test, as its own process ----------------------------------------


SECRET = "llmgw-" + "b" * 43  # the bench's API key (keys mode)
AUTH = b""  # the Authorization header line every request carries (keys mode)
# The bench key's concurrency: above the most requests the bench runs at once (64), so it
# never refuses, yet every request starts on a slot and the router renews them each second.
KEY_CONCURRENCY = 1000


def key_sources() -> dict[str, Any]:
    """A key table, leases and a usage sink for a router with keys on, in its process."""
    from llmgw.model.apikey import ApiKeyRecord, hash_secret
    from llmgw.server.peers.sessions import Peer
    from llmgw.server.tenants.limits import LimitBooks

    table = {"version": "v1", "keys": [{"name": "bench", "sha256": hash_secret(SECRET),
                                        "rpm": 10**9, "tpm": 10**12,
                                        "concurrency": KEY_CONCURRENCY}]}
    rec = ApiKeyRecord("bench", hash_secret(SECRET), "", rpm=10**9, tpm=10**12,
                       concurrency=KEY_CONCURRENCY)
    books = LimitBooks(lambda: {"bench": rec})
    peer = Peer(b"", "router", "bench")

    async def key_source(since: str) -> dict[str, Any]:
        return {"version": "v1", "unchanged": True} if since == "v1" else table

    async def lease_ask(op: Any) -> Any:
        await trio.lowlevel.checkpoint()
        return books.op_lease(peer, op, trio.current_time())

    async def usage_sink(op: Any) -> None:
        await trio.lowlevel.checkpoint()

    return {"key_source": key_source, "lease_ask": lease_ask, "usage_sink": usage_sink}


def run_router(port: int, urls: list[str], keys: bool = False) -> None:
    import logging

    from llmgw.config.router import RouterConfig, RouterKeysConfig
    from llmgw.router.service import serve_router

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")

    cfg = RouterConfig(
        server="tcp://127.0.0.1:1",
        keys=RouterKeysConfig("", ""),
        bind=f"127.0.0.1:{port}",
        table_poll_interval=3600.0,
    )
    snap = {
        "version": 1,
        "models": {"sim": [{"replica_id": f"r{i}", "url": u, "ready": True} for i, u in enumerate(urls)]},
    }

    async def source(since: int) -> dict[str, Any]:
        return snap

    extra = key_sources() if keys else {}
    try:  # as `llmgw router` does (a tree from before it, with --src, has none)
        from llmgw.router.service import tune_gc
    except ImportError:
        pass
    else:
        tune_gc()
    trio.run(lambda: serve_router(cfg, table_source=source, **extra))


# ---- load generator --------------------------------------------------------------------


def request_bytes(stream: bool) -> bytes:
    body = json.dumps(
        {
            "model": "sim",
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": EVENTS,
            "stream": stream,
        }
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        b"%scontent-length: %d\r\n\r\n%s" % (AUTH, len(body), body)
    )


async def one_conn(port: int, stream: bool, stop_at: float, lat: list[float], events: list[int]) -> None:
    req = request_bytes(stream)
    s = await trio.open_tcp_stream("127.0.0.1", port)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = b""
    async with s:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            await s.send_all(req)
            first = 0.0
            while b"\r\n\r\n" not in buf:
                buf += await s.receive_some(65536)
            head, _, buf = buf.partition(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(head.decode())
            low = head.lower()
            if b"content-length:" in low:
                n = int(low.split(b"content-length:")[1].split(b"\r\n")[0])
                while len(buf) < n:
                    buf += await s.receive_some(65536)
                buf = buf[n:]
                first = time.perf_counter()
            else:
                body = buf
                while True:
                    if not first and b"data:" in body:
                        first = time.perf_counter()
                    end = body.find(b"\r\n0\r\n\r\n")
                    if end >= 0:
                        events.append(body.count(b"data: {", 0, end))
                        buf = body[end + 7 :]
                        break
                    data = await s.receive_some(65536)
                    if not data:
                        raise RuntimeError("closed mid-stream")
                    body += data
            lat.append(first - t0)


def cpu_of(pid: int | None) -> float:
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def pct(xs: list[float], p: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(p * len(ys)))] if ys else float("nan")


def measure(port: int, stream: bool, conc: int, seconds: float, pid: int | None) -> dict[str, float]:
    lat: list[float] = []
    events: list[int] = []

    async def main() -> None:
        # warm-up: open connections, one round each
        async with trio.open_nursery() as n:
            for _ in range(conc):
                n.start_soon(one_conn, port, stream, time.perf_counter() + 0.3, [], [])
        c0 = cpu_of(pid)
        t0 = time.perf_counter()
        async with trio.open_nursery() as n:
            for _ in range(conc):
                n.start_soon(one_conn, port, stream, t0 + seconds, lat, events)
        wall = time.perf_counter() - t0
        res["cpu"] = cpu_of(pid) - c0
        res["wall"] = wall

    res: dict[str, float] = {}
    trio.run(main)
    n = len(lat)
    res.update(
        n=n,
        rps=n / res["wall"],
        p50=pct(lat, 0.5) * 1e3,
        p99=pct(lat, 0.99) * 1e3,
        eps=sum(events) / res["wall"],
        cpu_per_req=res["cpu"] / n * 1e3 if n else float("nan"),
    )
    return res


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the runs (figure by figure)."""
    return {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in runs[0]}


SRC = ROOT / "src"


def spawn(args: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen[bytes]:
    full = dict(os.environ)
    full.update(env or {})
    full["PYTHONPATH"] = str(SRC) + os.pathsep + full.get("PYTHONPATH", "")
    err = log.open("wb") if log is not None else subprocess.DEVNULL
    return subprocess.Popen(args, env=full, stdout=subprocess.DEVNULL, stderr=err)


def wait_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        os.kill(p.pid, signal.SIGKILL)
    p.wait()


def start_engines(kind: str, n: int = 2, tps: str = "1000000") -> tuple[list[subprocess.Popen[bytes]], list[int]]:
    procs, ports = [], []
    for _ in range(n):
        port = free_port()
        if kind == "stub":
            args = [sys.executable, __file__, "--stub-engine", str(port)]
            env = None
        else:
            args = [sys.executable, "-m", "llmgw.simengine", "serve", "org/sim", "--host",
                    "127.0.0.1", "--port", str(port), "--served-model-name", "sim"]  # fmt: skip
            env = {"LLMGW_SIM_TTFT": "0", "LLMGW_SIM_TOKENS_PER_SECOND": tps,
                   "LLMGW_SIM_MAX_RUNNING": "100000"}
        procs.append(spawn(args, env))
        ports.append(port)
    for port in ports:
        wait_port(port)
    return procs, ports


def peers(urls: list[str]) -> list[tuple[str, Callable[[int], list[str]]]]:
    """Peer routers that are installed, as (name, argv for a port)."""
    out: list[tuple[str, Callable[[int], list[str]]]] = []
    if shutil.which("vllm-router"):
        out.append(("vllm-router", lambda p: ["vllm-router", "--worker-urls", *urls,
                    "--host", "127.0.0.1", "--port", str(p),
                    "--prometheus-host", "127.0.0.1"]))  # fmt: skip
    else:
        print("vllm-router: not installed (pip install vllm-router), skipped")
    if shutil.which("sglang-router") or _importable("sglang_router"):
        out.append(("sglang-router", lambda p: [sys.executable, "-m", "sglang_router.launch_router",
                    "--worker-urls", *urls, "--host", "127.0.0.1", "--port", str(p),
                    "--prometheus-host", "127.0.0.1"]))  # fmt: skip
    else:
        print("sglang-router: not installed (pip install sglang-router), skipped")
    if not shutil.which("litellm"):
        print("LiteLLM proxy: not installed (pip install 'litellm[proxy]'), skipped")
    return out


def _importable(mod: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(mod) is not None


# ---- burst mode ------------------------------------------------------------------------


def proc_figures(pid: int) -> tuple[int, int]:
    """(RSS KiB, open descriptors) of a process now."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


async def burst_conn(port: int, req: bytes, go: trio.Event, opened: list[int], out: dict[str, Any]) -> None:
    try:
        s = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError as exc:
        out["errors"][f"client connect: {exc.strerror or exc}"] = out["errors"].get(
            f"client connect: {exc.strerror or exc}", 0) + 1
        opened.append(0)
        return
    opened.append(1)
    kind = ""
    async with s:
        await go.wait()
        try:
            await s.send_all(req)
            buf = b""
            while b"\r\n\r\n" not in buf:
                data = await s.receive_some(65536)
                if not data:
                    kind = "closed before the response head"
                    break
                buf += data
            if not kind:
                head, _, body = buf.partition(b"\r\n\r\n")
                status = int(head.split()[1])
                out["ttfb"].append(time.perf_counter() - out["t0"])
                if status in (429, 503):
                    out["refused"] += 1
                    if b"retry-after:" in head.lower():
                        out["retry_after"] += 1
                    return
                if status != 200:
                    kind = f"HTTP {status}: " + body[:200].decode(errors="replace")
                else:
                    while not body.endswith(b"0\r\n\r\n"):
                        data = await s.receive_some(65536)
                        if not data:
                            kind = "cut mid-stream"
                            break
                        body += data
                    if not kind:
                        if b"data: [DONE]" in body and b'"error"' not in body:
                            out["completed"] += 1
                            return
                        kind = "stream ended with an error event"
        except (trio.BrokenResourceError, OSError) as exc:
            kind = f"connection broken: {type(exc).__name__}"
    out["errors"][kind] = out["errors"].get(kind, 0) + 1


def burst(port: int, n: int, tokens: int, pid: int) -> dict[str, Any]:
    body = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": tokens, "stream": True}).encode()
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
           b"content-length: %d\r\n\r\n%s" % (len(body), body))
    out: dict[str, Any] = {"completed": 0, "refused": 0, "retry_after": 0, "errors": {}, "ttfb": [],
                           "t0": 0.0, "rss_max": 0, "fds_max": 0}

    async def sample(stop: trio.Event) -> None:
        while not stop.is_set():
            rss, fds = proc_figures(pid)
            out["rss_max"] = max(out["rss_max"], rss)
            out["fds_max"] = max(out["fds_max"], fds)
            with trio.move_on_after(0.05):
                await stop.wait()

    async def main() -> None:
        go, stop = trio.Event(), trio.Event()
        opened: list[int] = []
        out["rss_before"], out["fds_before"] = proc_figures(pid)
        async with trio.open_nursery() as outer:
            outer.start_soon(sample, stop)
            async with trio.open_nursery() as nursery:
                for _ in range(n):
                    nursery.start_soon(burst_conn, port, req, go, opened, out)
                while len(opened) < n:
                    await trio.sleep(0.05)
                await trio.sleep(0.5)  # the router has accepted them all
                out["t0"] = time.perf_counter()
                go.set()
            out["wall"] = time.perf_counter() - out["t0"]
            await trio.sleep(1.0)
            stop.set()
        out["rss_after"], out["fds_after"] = proc_figures(pid)

    trio.run(main)
    return out


def run_burst(a: argparse.Namespace) -> None:
    engines, eports = start_engines("sim", a.replicas, str(a.tokens_per_second))
    urls = [f"http://127.0.0.1:{p}" for p in eports]
    rport = free_port()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-router-{rport}.log"
    router = spawn([sys.executable, __file__, "--router", str(rport), *urls], log=log)
    try:
        wait_port(rport)
        time.sleep(0.5)
        for n in a.burst:
            r = burst(rport, n, a.tokens, router.pid)
            ttfb = r["ttfb"]
            errs = sum(r["errors"].values())
            print(f"burst {n}: completed {r['completed']}, refused {r['refused']} "
                  f"({r['retry_after']} with Retry-After), errors {errs} {dict(r['errors']) or ''}; "
                  f"TTFB p50 {pct(ttfb, 0.5) * 1e3:.0f} ms p99 {pct(ttfb, 0.99) * 1e3:.0f} ms; "
                  f"all done in {r['wall']:.1f} s; router RSS {r['rss_before'] // 1024}"
                  f"→{r['rss_max'] // 1024}→{r['rss_after'] // 1024} MiB, fds {r['fds_before']}"
                  f"→{r['fds_max']}→{r['fds_after']}", flush=True)
            time.sleep(2.0)
        text = log.read_text(errors="replace")
        print(f"router log: {text.count('ejected for')} ejections; "
              + "; ".join(ln for ln in text.splitlines() if "open-file limit" in ln))
    finally:
        for p in [router, *engines]:
            stop(p)


def run_keys(a: argparse.Namespace) -> None:
    global AUTH
    AUTH = b"authorization: Bearer %s\r\n" % SECRET.encode()
    engines, eports = start_engines(a.engine)
    urls = [f"http://127.0.0.1:{p}" for p in eports]
    off_port, on_port = free_port(), free_port()
    off = spawn([sys.executable, __file__, "--router", str(off_port), *urls])
    on = spawn([sys.executable, __file__, "--keys-router", str(on_port), *urls])
    try:
        wait_port(off_port)
        wait_port(on_port)
        reps = f", median of {a.repeat}, interleaved" if a.repeat > 1 else ""
        print(f"keys off vs on; engine: {a.engine} x2, {a.seconds:g}s per cell{reps}")
        print(f"{'mode':<8}{'conc':>5}{'off req/s':>11}{'on req/s':>10}{'off cpu ms':>12}"
              f"{'on cpu ms':>11}{'on/off':>8}")
        for stream in (False, True):
            for conc in (1, 64):
                runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
                for _ in range(a.repeat):
                    runs["off"].append(measure(off_port, stream, conc, a.seconds, off.pid))
                    runs["on"].append(measure(on_port, stream, conc, a.seconds, on.pid))
                r0, r1 = median_of(runs["off"]), median_of(runs["on"])
                print(f"{'stream' if stream else 'plain':<8}{conc:>5}{r0['rps']:>11.0f}{r1['rps']:>10.0f}"
                      f"{r0['cpu_per_req']:>12.3f}{r1['cpu_per_req']:>11.3f}"
                      f"{r1['cpu_per_req'] / r0['cpu_per_req']:>8.2f}")
    finally:
        for p in [off, on, *engines]:
            stop(p)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["sim", "stub"], default="sim")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--repeat", type=int, default=1, help="measure each cell N times, print medians")
    ap.add_argument("--burst", type=int, nargs="+", help="burst mode: N streams at once (several: in turn)")
    ap.add_argument("--replicas", type=int, default=4, help="burst mode: engines behind the router")
    ap.add_argument("--tokens", type=int, default=32, help="burst mode: events per stream")
    ap.add_argument("--tokens-per-second", type=int, default=100, help="burst mode: engine pace")
    ap.add_argument("--src", help="run the router from this source tree (before/after figures)")
    ap.add_argument("--keys", action="store_true", help="keys mode: keys, usage and limits on vs off")
    ap.add_argument("--keys-router", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--stub-engine", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--router", type=int, help=argparse.SUPPRESS)
    ap.add_argument("urls", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.stub_engine:
        return run_stub(a.stub_engine)
    if a.router:
        return run_router(a.router, a.urls)
    if a.keys_router:
        return run_router(a.keys_router, a.urls, keys=True)
    if a.keys:
        return run_keys(a)
    if a.src:
        global SRC
        SRC = Path(a.src).resolve()
    if a.burst:
        return run_burst(a)

    engines, eports = start_engines(a.engine)
    urls = [f"http://127.0.0.1:{p}" for p in eports]
    rport = free_port()
    router = spawn([sys.executable, __file__, "--router", str(rport), *urls])
    others: list[subprocess.Popen[bytes]] = []
    try:
        wait_port(rport)
        targets: list[tuple[str, int, int | None]] = [("direct", eports[0], None)]
        targets.append(("llmgw", rport, router.pid))
        for name, argv in peers(urls):
            port = free_port()
            p = spawn(argv(port))
            others.append(p)
            try:
                wait_port(port, 30)
            except RuntimeError:
                print(f"{name}: did not start, skipped")
                continue
            targets.append((name, port, p.pid))
        reps = f", median of {a.repeat}" if a.repeat > 1 else ""
        print(f"engine: {a.engine} x2, {a.seconds:g}s per cell{reps}, cpu tick {1 / TICK * 1e3:g} ms")
        hdr = f"{'target':<14}{'mode':<8}{'conc':>5}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}"
        print(hdr + f"{'+p50':>8}{'+p99':>8}{'ev/s':>9}{'cpu ms/req':>11}")
        for stream in (False, True):
            for conc in (1, 64):
                base: dict[str, float] | None = None
                for name, port, pid in targets:
                    # direct: one engine; routers spread over two, so direct at conc 64 is
                    # the latency reference only.
                    r = median_of([measure(port, stream, conc, a.seconds, pid) for _ in range(a.repeat)])
                    if base is None:
                        base = r
                    add50 = r["p50"] - base["p50"]
                    add99 = r["p99"] - base["p99"]
                    cpu = f"{r['cpu_per_req']:.3f}" if pid else "-"
                    print(
                        f"{name:<14}{'stream' if stream else 'plain':<8}{conc:>5}"
                        f"{r['rps']:>9.0f}{r['p50']:>9.3f}{r['p99']:>9.3f}"
                        f"{add50:>8.3f}{add99:>8.3f}{r['eps']:>9.0f}{cpu:>11}"
                    )
    finally:
        for p in [router, *others, *engines]:
            stop(p)


if __name__ == "__main__":
    main()
