"""Slowloris: 200 connections trickling a request head are answered 408 and closed at
header_timeout (1 s here), and meanwhile a well-behaved client keeps its median latency
within twice what it measured idle, in the same test."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_router_fuzz import MODEL, RouterProc, start_engines

HEADER_TIMEOUT = 1.0
CONNS = 200
WINDOW = 4.0  # seconds of slowloris, connections opened again as they are closed
TRICKLE = 0.2  # one byte per connection this often


@pytest.fixture
def router(tmp_path: Path) -> Iterator[RouterProc]:
    engs = start_engines(tmp_path)
    r = RouterProc(tmp_path, engs, extra=f'header_timeout = "{HEADER_TIMEOUT:g}s"')
    try:
        yield r
    finally:
        r.stop()
        for e in engs:
            e.stop()


BODY = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
REQUEST = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY)


def latencies(port: int, n: int, stop: threading.Event | None = None) -> list[float]:
    """Keep-alive requests one after another: each one's time to its whole response."""
    out: list[float] = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while len(out) < n or (stop is not None and not stop.is_set()):
            t0 = time.perf_counter()
            s.sendall(REQUEST)
            buf = b""
            while b"\r\n\r\n" not in buf:
                data = s.recv(65536)
                assert data, buf
                buf += data
            head, _, rest = buf.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            while len(rest) < length:
                rest += s.recv(65536)
            out.append(time.perf_counter() - t0)
            if stop is None and len(out) >= n:
                break
    return out


class Loris:
    """CONNS connections that each send a head one byte every TRICKLE seconds, opened
    again as the router closes them, for WINDOW seconds."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.closed: list[tuple[float, bytes]] = []  # (seconds it lived, what it got)
        self.stop = threading.Event()

    def open(self) -> tuple[socket.socket, float, int]:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        s.setblocking(False)
        return s, time.monotonic(), 0

    def run(self) -> None:
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 10_000
        conns = [self.open() for _ in range(CONNS)]
        end = time.monotonic() + WINDOW
        while time.monotonic() < end:
            for i, (s, born, sent) in enumerate(conns):
                try:
                    got = s.recv(65536)
                except BlockingIOError:
                    got = None
                except ConnectionResetError:
                    got = b""
                if got is not None:
                    rest = b""
                    s.setblocking(True)
                    s.settimeout(2)
                    try:
                        while more := s.recv(65536):
                            rest += more
                    except (ConnectionResetError, TimeoutError):
                        pass
                    self.closed.append((time.monotonic() - born, got + rest))
                    s.close()
                    conns[i] = self.open()
                    continue
                try:
                    s.send(head[sent : sent + 1])
                    conns[i] = (s, born, sent + 1)
                except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                    pass
            time.sleep(TRICKLE)
        for s, _, _ in conns:
            s.close()
        self.stop.set()


def one_round(router: RouterProc) -> tuple[float, float, Loris]:
    idle = statistics.median(latencies(router.port, 100))
    loris = Loris(router.port)
    t = threading.Thread(target=loris.run)
    t.start()
    time.sleep(HEADER_TIMEOUT / 2)  # all 200 are open and trickling
    busy = statistics.median(latencies(router.port, 100, loris.stop))
    t.join()
    return idle, busy, loris


@pytest.mark.slow
def test_slowloris_closed_at_header_timeout_and_others_served(router: RouterProc) -> None:
    latencies(router.port, 20)  # warm up: engine connections pooled
    # The latency bound is compared on a shared machine: a round whose figures another
    # process disturbed is measured again (idle first each time), up to three rounds.
    for _ in range(3):
        idle, median, loris = one_round(router)
        assert router.alive(), router.text()[-2000:]
        assert len(loris.closed) >= CONNS, len(loris.closed)
        for lived, got in loris.closed:
            assert got.startswith(b"HTTP/1.1 408 "), got[:200]
            assert b"connection: close" in got.lower()
            err = json.loads(got.partition(b"\r\n\r\n")[2])["error"]
            assert err["code"] == "request_timeout"
            assert HEADER_TIMEOUT * 0.9 <= lived <= HEADER_TIMEOUT + 1.5, lived
        print(
            f"idle median {idle * 1e3:.2f} ms, under slowloris {median * 1e3:.2f} ms, {len(loris.closed)} closed"
        )
        if median <= 2 * idle:
            break
    assert median <= 2 * idle, f"median {median * 1e3:.2f} ms under slowloris, {idle * 1e3:.2f} ms idle"
