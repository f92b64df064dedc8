"""A real router process under generated hostile HTTP: it never exits, answers every request
with a well-formed response (a 4xx with OpenAI's error shape when the request is bad, never
a 500), and keeps serving a well-behaved client meanwhile.

LLMGW_FUZZ_REQUESTS sets how many generated requests (default 10,000; a CI or bench step
can run 100,000). The router runs as its own process (`python this_file.py serve CONF
TABLE`): its router.toml is loaded by the strict loader, its endpoint table is a static
source in front of two simulated engines.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fakes.engines import SimEngineProcess, free_port, vllm_args

MODEL = "sim"
FUZZ_REQUESTS = int(os.environ.get("LLMGW_FUZZ_REQUESTS", "10000"))
CLIENTS = 4


# ---- the router as its own process ---------------------------------------------------------


def serve(conf: str, table_file: str) -> None:
    import trio

    from llmgw.config.load_router import load_router_config
    from llmgw.router.service import serve_router

    cfg = load_router_config(conf)
    snap = json.loads(Path(table_file).read_text())

    async def source(since: int) -> dict[str, Any]:
        return snap

    async def main() -> None:
        async with trio.open_nursery() as n:
            host, port = await n.start(
                lambda task_status: serve_router(cfg, table_source=source, task_status=task_status)
            )
            print(f"listening {host}:{port}", flush=True)

    trio.run(main)


class RouterProc:
    def __init__(self, tmp: Path, engines: list[SimEngineProcess], extra: str = "") -> None:
        from llmgw.transport import keys

        keys_dir = tmp / "keys"
        keys.init_keys(str(keys_dir))
        keys.issue_key(str(keys_dir), "router", "edge")
        self.port = free_port()
        conf = tmp / "router.toml"
        conf.write_text(
            f'bind = "127.0.0.1:{self.port}"\nserver = "tcp://127.0.0.1:1"\n'
            f'table_poll_interval = "1h"\nmax_body_bytes = 65536\n{extra}\n'
            f'[keys]\nsecret_key = "{keys_dir / "edge.key_secret"}"\n'
            f'server_key = "{keys_dir / "server.key"}"\n'
        )
        table = tmp / "table.json"
        models = [{"replica_id": f"r{i}", "url": e.url, "ready": True} for i, e in enumerate(engines)]
        table.write_text(json.dumps({"version": 1, "models": {MODEL: models}}))
        self.log = tmp / "router.log"
        self._fh = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        tests = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
        self.p = subprocess.Popen(
            [sys.executable, __file__, "serve", str(conf), str(table)],
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + 20
        try:
            while "listening" not in self.text():
                assert self.p.poll() is None, self.text()
                assert time.monotonic() < deadline, "router did not start"
                time.sleep(0.05)
        except AssertionError:
            self.stop()
            raise

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.p.poll() is None

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)
        self._fh.close()


def start_engines(tmp: Path) -> list[SimEngineProcess]:
    env = {"LLMGW_SIM_TTFT": "0", "LLMGW_SIM_TOKENS_PER_SECOND": "100000"}
    engs = [SimEngineProcess.start(vllm_args(free_port(), MODEL), env=env, log_dir=tmp) for _ in range(2)]
    for e in engs:
        e.wait_healthy()
    return engs


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    tmp = tmp_path_factory.mktemp("fuzz")
    engs = start_engines(tmp)
    r = RouterProc(tmp, engs)
    try:
        yield r
    finally:
        r.stop()
        for e in engs:
            e.stop()


# ---- a strict response reader (independent of the router's own parser) ---------------------

_STATUS = re.compile(rb"HTTP/1\.1 ([1-5][0-9][0-9]) [^\r\n]*")
ERROR_KEYS = {"message", "type", "param", "code"}


class Closed(Exception):
    pass


def read_all(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            data = s.recv(65536)
        except (ConnectionResetError, TimeoutError):
            return out
        if not data:
            return out
        out += data


def responses(raw: bytes) -> list[tuple[int, bytes, bytes]]:
    """Every response in `raw` as (status, head, body); AssertionError if malformed."""
    out = []
    while raw:
        end = raw.find(b"\r\n\r\n")
        assert end > 0, f"no end of head in {raw[:200]!r}"
        lines = raw[:end].split(b"\r\n")
        m = _STATUS.fullmatch(lines[0])
        assert m, lines[0]
        fields = {}
        for line in lines[1:]:
            k, sep, v = line.partition(b": ")
            assert sep and re.fullmatch(rb"[a-z-]+", k), line
            fields[k] = v
        rest = raw[end + 4 :]
        status = int(m.group(1))
        if status == 100:
            raw = rest
            continue
        if b"content-length" in fields:
            n = int(fields[b"content-length"])
            assert len(rest) >= n, "short body"
            body, raw = rest[:n], rest[n:]
        elif fields.get(b"transfer-encoding") == b"chunked":
            parts = []
            while True:
                nl = rest.find(b"\r\n")
                assert nl > 0 and re.fullmatch(rb"[0-9a-f]+", rest[:nl]), rest[:40]
                size = int(rest[:nl], 16)
                parts.append(rest[nl + 2 : nl + 2 + size])
                assert rest[nl + 2 + size : nl + 4 + size] == b"\r\n"
                rest = rest[nl + 4 + size :]
                if size == 0:
                    break
            body, raw = b"".join(parts), rest
        else:
            body, raw = rest, b""
        out.append((status, b"\r\n".join(lines), body))
    return out


def check(raw: bytes, sent: bytes) -> list[int]:
    got = responses(raw)
    if sent.strip(b"\r\n") and not got:
        raise AssertionError(f"no response to {sent[:300]!r}")
    for status, _head, body in got:
        assert status != 500 and status < 600, (status, sent[:300], body[:300])
        if status >= 400:
            err = json.loads(body)["error"]
            assert set(err) == ERROR_KEYS and err["message"], body
    return [g[0] for g in got]


def exchange(port: int, data: bytes, timeout: float = 10, shut: bool = True) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
            if shut:
                s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the router answered and closed before taking it all
        return read_all(s)


# ---- generated requests ---------------------------------------------------------------------


def post(path: bytes, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n%s"
        % (
            path,
            extra,
            len(body),
            body,
        )
    )


def chunked(path: bytes, body: bytes) -> bytes:
    half = len(body) // 2
    return (
        b"POST %s HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n%x;e=1\r\n%s\r\n0\r\n\r\n"
        % (
            path,
            half,
            body[:half],
            len(body) - half,
            body[half:],
        )
    )


GOOD = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
CLOSE = b"connection: close\r\n"
# Served by the engines: sent as they are, with `connection: close`, read to the end. (The
# fuzzed ones are sent and then the client's half of the connection is shut, which the
# router takes for a client gone: a request it relays to an engine would be dropped.)
ROUTED = [
    post(b"/v1/completions", GOOD, CLOSE),
    post(b"/v1/completions", b'{"model": "sim", "prompt": [5], "max_tokens": 1}', CLOSE),
    chunked(b"/v1/completions", GOOD).replace(b"host: x\r\n", b"host: x\r\n" + CLOSE),
]
NOPE = json.dumps({"model": "nope", "prompt": "x", "max_tokens": 1}).encode()
SEEDS = [
    b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n",
    b"GET /v1/models HTTP/1.0\r\n\r\n",
    post(b"/v1/completions", NOPE),
    chunked(b"/v1/completions", NOPE),
    post(b"/v1/chat/completions", b'{"model": "nope", "messages": []}', b"expect: 100-continue\r\n"),
    post(b"/v1/completions", b"{not json"),
    post(b"/v1/embeddings", b"[1, 2]"),
    b"GET /nowhere HTTP/1.1\r\n\r\n",
]
TOKENS = [
    b"\r\n", b"\r", b"\n", b":", b" ", b"\t", b";", b"0", b"9" * 30, b"0x", b"_", b"+", b"-", b"\x00", b"\xff",
    b"\r\n\r\n", b"content-length: 3\r\n", b"transfer-encoding: chunked\r\n", b"expect: 100-continue\r\n",
    b"connection: close\r\n", b"[" * 200, b"{\"model\": ", b"\"", b"\\",
]  # fmt: skip


def mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        pos = rng.randint(0, len(b))
        if op == 0 and b:
            del b[pos : pos + rng.randint(1, 6)]
        elif op == 1:
            b[pos:pos] = rng.choice(TOKENS)
        elif op == 2:
            b[pos:pos] = rng.randbytes(rng.randint(1, 6))
        elif op == 3 and b:
            b[min(pos, len(b) - 1)] = rng.randrange(256)
        else:  # repeat a span (duplicate header lines, pipelined requests)
            end = min(len(b), pos + rng.randint(1, 60))
            b[pos:pos] = b[pos:end]
    return bytes(b)


def generate(rng: random.Random) -> tuple[bytes, bool]:
    """A request and whether it is fuzzed (else one the engines serve)."""
    r = rng.random()
    if r < 0.03:
        return rng.choice(ROUTED), False
    if r < 0.08:
        return rng.randbytes(rng.randint(1, 200)), True
    if r < 0.11:
        return rng.choice(SEEDS), True
    if r < 0.115:  # rare and large: over the head or field limits, deep JSON, long numbers
        big = [
            b"GET / HTTP/1.1\r\nx: " + b"a" * 70_000 + b"\r\n\r\n",
            b"GET / HTTP/1.1\r\n" + b"x: v\r\n" * 200 + b"\r\n",
            post(b"/v1/completions", b"[" * 20_000 + b"]" * 20_000),
            post(b"/v1/completions", b'{"model": "sim", "n": ' + b"9" * 5000 + b"}"),
        ]
        return rng.choice(big), True
    return mutate(rng, rng.choice(SEEDS)), True


# ---- the tests -------------------------------------------------------------------------------


def well_behaved(port: int, stop: threading.Event, results: list[str]) -> None:
    import openai

    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=10)
    while not stop.is_set():
        try:
            out = c.completions.create(model=MODEL, prompt="hello", max_tokens=2)
            results.append("ok" if out.choices else "empty")
        except Exception as exc:  # noqa: BLE001 - recorded, asserted on below
            results.append(f"error: {exc!r}")
        time.sleep(0.01)


@pytest.mark.slow
def test_generated_requests_never_break_the_router(router: RouterProc) -> None:
    rng = random.Random(int(os.environ.get("LLMGW_FUZZ_SEED", "9")))
    work = [generate(rng) for _ in range(FUZZ_REQUESTS)]
    failures: list[str] = []
    statuses: dict[int, int] = {}
    lock = threading.Lock()

    def client(items: list[tuple[bytes, bool]]) -> None:
        for data, fuzzed in items:
            try:
                got = check(exchange(router.port, data, shut=fuzzed), data)
                if not fuzzed:
                    assert got == [200], got
            except (AssertionError, ValueError, KeyError) as exc:
                with lock:
                    failures.append(f"{exc!r} for {data[:200]!r}")
                continue
            with lock:
                for s in got:
                    statuses[s] = statuses.get(s, 0) + 1

    stop = threading.Event()
    good: list[str] = []
    threads = [threading.Thread(target=client, args=(work[i::CLIENTS],)) for i in range(CLIENTS)]
    meanwhile = threading.Thread(target=well_behaved, args=(router.port, stop, good))
    meanwhile.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    meanwhile.join()
    assert router.alive(), router.text()[-3000:]
    if failures:
        (router.log.parent / "failures.txt").write_text("\n".join(failures))
    assert not failures, f"{len(failures)} failures, in {router.log.parent / 'failures.txt'}: {failures[:3]}"
    assert good and all(g == "ok" for g in good), [g for g in good if g != "ok"][:5]
    # Bad requests were refused with 4xx, some good ones served, and no handler failed.
    assert sum(n for s, n in statuses.items() if 400 <= s < 500) > FUZZ_REQUESTS // 2, statuses
    assert statuses.get(200, 0) > 0, statuses
    assert "llmgw_router_handler_errors_total 0.0" in router.metrics()


# Each of these broke the router before (issue 9): it exited, or the request was accepted.


def test_crash_huge_content_length(router: RouterProc) -> None:
    data = post(b"/v1/completions", b"", b"")
    data = data.replace(b"content-length: 0", b"content-length: " + b"1" * 5000)
    assert check(exchange(router.port, data), data) == [413]
    assert router.alive()


def test_crash_deep_json(router: RouterProc) -> None:
    body = b"[" * 100_000 + b"]" * 100_000
    data = post(b"/v1/completions", body[:30_000] + body[-30_000:])
    assert check(exchange(router.port, data), data) == [400]
    deep = b'{"model": "sim", "prompt": ' + b"[" * 129 + b"]" * 129 + b"}"
    assert check(exchange(router.port, post(b"/v1/completions", deep)), deep) == [400]
    assert router.alive()


@pytest.mark.parametrize("size", [b"0x2", b"0_2", b"+2", b"2 ", b"-2"])
def test_smuggling_chunk_sizes_refused(router: RouterProc, size: bytes) -> None:
    data = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n%s\r\n{}\r\n0\r\n\r\n"
        % size
    )
    assert check(exchange(router.port, data), data) == [400]


def test_smuggling_length_and_chunked_refused(router: RouterProc) -> None:
    data = post(b"/v1/completions", GOOD, b"transfer-encoding: chunked\r\n")
    assert check(exchange(router.port, data), data) == [400]


def test_head_limits_in_one_write(router: RouterProc) -> None:
    line = b"GET /health HTTP/1.1\r\nx: " + b"a" * 100_000 + b"\r\n\r\n"
    assert check(exchange(router.port, line), line) == [431]
    fields = b"GET /health HTTP/1.1\r\n" + b"x: v\r\n" * 10_000 + b"\r\n"
    assert check(exchange(router.port, fields), fields) == [431]
    assert router.alive()


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve(sys.argv[2], sys.argv[3])
