"""Mid-stream failover against real engines: two vLLM CPU engines serving the tiny Llama
behind the router (in-process, a table of the two); a greedy completion stream is cut by
SIGKILL of the engine serving it, and the client still gets one whole answer: one id, one
usage counting the tokens asked for (`ignore_eos`), one [DONE], no error event. Then the chat
continuation the router builds (a final assistant message, `continue_final_message`,
`add_generation_prompt: false`, `continuous_usage_stats`) is sent to the survivor as it
is: vLLM takes it and continues the message. Every engine is killed by its pid at the end."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from fakes.engines import free_port
from fakes.vllm_rig import DTYPE, ENGINE_ENV, READY_TIMEOUT
from llmgw.config.router import RouterConfig, RouterKeysConfig
from llmgw.router.connection.resume import Stream
from llmgw.router.service import serve_router

pytestmark = pytest.mark.real_engine

MODEL = "tiny"
TOKENS = 1500  # with ignore_eos: still being generated after CUT_AFTER events (max-model-len 2048)
CUT_AFTER = 10  # events the client reads before the engine is killed


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return str(r.read().decode())
    except OSError:
        return None


def _running(url: str) -> float:
    for line in (_get(url + "/metrics") or "").splitlines():
        if line.startswith("vllm:num_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _events(resp: http.client.HTTPResponse) -> Any:
    buf = b""
    while True:
        data = resp.read1(65536)
        if not data:
            return
        buf += data
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            if ev.strip():
                assert ev.startswith(b"data: "), ev
                yield "[DONE]" if ev[6:] == b"[DONE]" else json.loads(ev[6:])


def _stream(port: int, path: str, body: dict[str, Any],
            each: Callable[[list[Any]], None] = lambda got: None) -> list[Any]:
    """The events of one stream; `each` sees those read so far after every one."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        got: list[Any] = []
        for ev in _events(resp):
            got.append(ev)
            each(got)
        return got
    finally:
        conn.close()


def _cut_stream(router: int, engines: list[tuple[trio.Process, str]]) -> tuple[list[Any], int]:
    """The stream through the router; the engine serving it killed after CUT_AFTER events.
    Returns the events and which engine was killed."""
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    killed = [-1]

    def each(got: list[Any]) -> None:
        if len(got) == CUT_AFTER:
            # Still generating: killed mid-answer, not after it (the router may hold the
            # rest already when the engine has finished).
            # Only while it still generates: the tiny model can finish before vLLM's gauge
            # says so, and then there is nothing to cut (the caller tries again).
            busy = [i for i, (_, url) in enumerate(engines) if _running(url) >= 1]
            if len(busy) != 1:
                return
            killed[0] = busy[0]
            os.killpg(engines[busy[0]][0].pid, signal.SIGKILL)

    return _stream(router, "/v1/completions", body, each), killed[0]


@asynccontextmanager
async def _engines(n: int, vllm_venv: Path, tiny_model: Path, tmp_path: Path
                   ) -> AsyncIterator[tuple[list[trio.Process], list[str]]]:
    """`n` vLLM engines serving the tiny Llama, ready; every one killed by its pid at the end."""
    env = {**os.environ, **ENGINE_ENV}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    procs: list[trio.Process] = []
    logs = []
    urls: list[str] = []
    try:
        for i in range(n):
            port = free_port()
            log = (tmp_path / f"engine-{i}.log").open("wb")
            logs.append(log)
            argv = [str(vllm_venv / "bin" / "vllm"), "serve", str(tiny_model), "--host", "127.0.0.1",
                    "--port", str(port), "--served-model-name", MODEL, "--max-model-len", "2048",
                    "--enforce-eager", *DTYPE]
            procs.append(await trio.lowlevel.open_process(argv, env=env, cwd=tmp_path, stdout=log,
                                                          stderr=subprocess.STDOUT, start_new_session=True))
            urls.append(f"http://127.0.0.1:{port}")
        with trio.fail_after(READY_TIMEOUT):
            for i, url in enumerate(urls):
                while await trio.to_thread.run_sync(_get, url + "/health") is None:
                    assert procs[i].poll() is None, (tmp_path / f"engine-{i}.log").read_text()[-3000:]
                    await trio.sleep(1)
        yield procs, urls
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                with trio.move_on_after(30):
                    await p.wait()
        for log in logs:
            log.close()


class _Source:
    def __init__(self, snap: dict[str, Any]) -> None:
        self.snap = snap

    async def __call__(self, since: int) -> dict[str, Any]:
        return self.snap


async def test_a_killed_engine_s_stream_goes_on_on_the_other(vllm_venv: Path, tiny_model: Path,
                                                           tmp_path: Path, nursery: trio.Nursery) -> None:
    async with _engines(2, vllm_venv, tiny_model, tmp_path) as (procs, urls):
        cfg = RouterConfig(server="tcp://127.0.0.1:1", keys=RouterKeysConfig(secret_key="", server_key=""),
                           bind="127.0.0.1:0", first_byte_timeout=120, failover_timeout=120)
        snap = {"version": 1, "models": {MODEL: [{"replica_id": f"r{i}", "url": u, "ready": True}
                                                 for i, u in enumerate(urls)]}}
        _, router = await nursery.start(
            lambda task_status: serve_router(cfg, table_source=_Source(snap), task_status=task_status))
        await trio.sleep(0.2)  # the first table poll
        for _ in range(5):
            events, killed = await trio.to_thread.run_sync(
                _cut_stream, router, list(zip(procs, urls, strict=True)))
            if killed >= 0:
                break
        assert killed >= 0
        with trio.fail_after(30):
            await procs[killed].wait()
        survivor = urls[1 - killed]
        objs = [e for e in events if isinstance(e, dict)]
        assert not [e for e in objs if "error" in e], objs[-3:]
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        assert len({(e["id"], e["created"]) for e in objs}) == 1
        choices = [c for e in objs for c in e["choices"]]
        assert choices[-1]["finish_reason"] == "length"
        # The usage: the killed engine's events (a floor of its tokens: vLLM merges the
        # outputs of steps its API server was too busy to send one by one) and the
        # survivor's own count, which with ignore_eos is the rest of TOKENS.
        usage = [e["usage"] for e in objs if e.get("usage")]
        assert len(usage) == 1 and usage[0]["completion_tokens"] == TOKENS, usage
        # At most one event per token; fewer where vLLM merged steps.
        assert CUT_AFTER < len(choices) <= TOKENS
        metrics = await trio.to_thread.run_sync(_get, f"http://127.0.0.1:{router}/metrics")
        assert 'llmgw_router_stream_failovers_total{model="tiny",outcome="resumed"} 1.0' in (metrics or "")
        print(f"engine {killed} killed after {CUT_AFTER} events; usage {usage[0]}")

        # The chat continuation, as the router builds it, taken by vLLM itself.
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}],
                "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
        s = Stream("chat", chat, False)
        port = int(survivor.rsplit(":", 1)[1])
        first = await trio.to_thread.run_sync(_stream, port, "/v1/chat/completions", chat)
        for ev in first[:11]:  # the role chunk and 10 tokens
            s.observe(b"data: " + json.dumps(ev).encode() + b"\n\n")
        sent = "".join(s.text)
        assert sent and s.sent_tokens == 10  # events: a floor of the tokens
        body = json.loads(s.next_body() or b"")
        assert body["messages"][-1] == {"role": "assistant", "content": sent}
        rest = await trio.to_thread.run_sync(_stream, port, "/v1/chat/completions", body)
        objs = [e for e in rest if isinstance(e, dict)]
        assert not [e for e in objs if "error" in e], objs
        assert not [c for e in objs for c in e["choices"] if c["delta"].get("role") and
                    c["delta"].get("content")], "the continuation started a new message"
        assert "".join(c["delta"].get("content") or "" for e in objs for c in e["choices"])
        # continuous_usage_stats: usage in every chunk, completion tokens counting up.
        counts = [e["usage"]["completion_tokens"] for e in objs if e.get("choices")]
        assert counts == sorted(counts) and 0 < counts[-1] <= 30
        print(f"chat continuation: prompt {objs[-1]['usage']['prompt_tokens']} tokens "
              f"(the original's + the {s.sent_tokens} sent, as re-tokenized)")


STREAMS = 6  # at once, spread over the engines by the router


def _load(router: int, urls: list[str], victim: Callable[[], None]) -> list[list[Any]]:
    """STREAMS greedy streams at once through the router; `victim()` kills an engine once
    every stream has read CUT_AFTER events. Returns each stream's events."""
    import threading
    ready = threading.Barrier(STREAMS + 1)
    out: list[list[Any]] = [[] for _ in range(STREAMS)]
    reached = [False] * STREAMS

    def one(i: int) -> None:
        body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

        def each(got: list[Any]) -> None:
            if len(got) == CUT_AFTER and not reached[i]:
                reached[i] = True
                ready.wait(timeout=120)

        try:
            out[i] = _stream(router, "/v1/completions", body, each)
        finally:
            if not reached[i]:
                ready.abort()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    ready.wait(timeout=120)  # every stream is mid-way
    victim()
    for t in threads:
        t.join(timeout=300)
    return out


def _whole(events: list[Any]) -> bool:
    objs = [e for e in events if isinstance(e, dict)]
    usage = [e["usage"] for e in objs if e.get("usage")]
    return (bool(events) and events[-1] == "[DONE]" and not [e for e in objs if "error" in e]
            and len({e["id"] for e in objs}) == 1 and len(usage) == 1
            and usage[0]["completion_tokens"] == TOKENS)


async def test_streams_under_load_cut_before_and_whole_after(vllm_venv: Path, tiny_model: Path,
                                                             tmp_path: Path, nursery: trio.Nursery) -> None:
    """Three engines, STREAMS streams at once through a router: one engine SIGKILLed
    mid-way with failover off (failover_migrations = 0), then another with it on. Off, the
    killed engine's streams end with an error event; on, every stream is whole (one id,
    one usage of every token asked for, one [DONE])."""
    from llmgw.config.router import ModelRouteConfig

    async with _engines(3, vllm_venv, tiny_model, tmp_path) as (procs, urls):
        snap = {"version": 1, "models": {MODEL: [{"replica_id": f"r{i}", "url": u, "ready": True}
                                                 for i, u in enumerate(urls)]}}
        cut: dict[str, int] = {}
        for phase, migrations in (("off", 0), ("on", 1)):
            cfg = RouterConfig(server="tcp://127.0.0.1:1",
                               keys=RouterKeysConfig(secret_key="", server_key=""),
                               bind="127.0.0.1:0", first_byte_timeout=120, failover_timeout=120,
                               models={MODEL: ModelRouteConfig(failover_migrations=migrations)})
            scope = trio.CancelScope()

            async def run(task_status: trio.TaskStatus[Any], cfg: RouterConfig = cfg,
                          scope: trio.CancelScope = scope) -> None:
                with scope:
                    await serve_router(cfg, table_source=_Source(snap), task_status=task_status)

            _, router = await nursery.start(run)
            await trio.sleep(0.2)  # the first table poll
            killed: list[int] = []
            alive = [i for i, p in enumerate(procs) if p.poll() is None]

            def victim(killed: list[int] = killed, alive: list[int] = alive) -> None:
                # The engine generating the most of the streams now.
                running = {e: _running(urls[e]) for e in alive}
                busy = max(running, key=running.__getitem__)
                if running[busy] < 1:
                    return  # finished already, or not yet counted: the phase tries again
                killed.append(busy)
                os.killpg(procs[busy].pid, signal.SIGKILL)

            for _ in range(5):
                streams = await trio.to_thread.run_sync(_load, router, urls, victim)
                if killed:
                    break
            assert killed, "no engine was still generating when the streams were mid-way"
            metrics = await trio.to_thread.run_sync(_get, f"http://127.0.0.1:{router}/metrics") or ""
            scope.cancel()  # this phase's router
            resumed = sum(float(ln.rsplit(" ", 1)[1]) for ln in metrics.splitlines()
                          if ln.startswith("llmgw_router_stream_failovers_total{")
                          and 'outcome="resumed"' in ln)
            # Off, nothing is resumed; on, the killed engine's streams went on elsewhere.
            assert (resumed == 0) if phase == "off" else (resumed >= 1), metrics
            with trio.fail_after(30):
                await procs[killed[0]].wait()
            cut[phase] = sum(not _whole(s) for s in streams)
            if phase == "off":
                assert cut[phase] >= 1  # the killed engine had streams, and they were cut
                for s in streams:
                    if not _whole(s):
                        assert any(isinstance(e, dict) and "error" in e for e in s), s[-3:]
        assert cut["on"] == 0, cut
        print(f"{STREAMS} streams, an engine SIGKILLed mid-way: cut with failover off "
              f"{cut['off']}, on {cut['on']}")
