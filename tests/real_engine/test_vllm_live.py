"""llmgw's real processes (server, agent with simulated GPUs, router) running a real vLLM
(CPU build) serving the tiny Llama: ready, routed through the official openai client,
load read from its /metrics, adopted after an agent SIGKILL, restarted after an engine
SIGKILL, and gone, whole session, after `ctl delete`.

One engine is shared, in file order: the tests that kill things come last. Every wait is
bounded; every process started here is killed by pid at the end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from fakes.engine_keys import auth, url_key
from fakes.live import Cluster, Proc, engine_pids, wait_for
from fakes.nvidia_smi import pcie_box
from fakes.vllm_rig import DTYPE, READY_TIMEOUT, engine_log, leaders, tiny_yaml, vllm_agent
from fakes.web import series
from llmgw.agent.process import procs
from llmgw.router.routing.loadwatch import _RUNNING, _USAGE, _WAITING, parse_load

pytestmark = pytest.mark.real_engine

MODEL = "tiny"
ENGINE_ARGS = ["--max-model-len", "8192", "--enforce-eager", *DTYPE]
# The mid-stream disconnect's request: as long as make_model.py's 8,192 positions allow
# (about 15 s of generation here), so that a router that never passed the close on would
# be seen running it to its end.
MAX_TOKENS = 8000


class Rig:
    def __init__(self, root: Path, venv: Path, model: Path) -> None:
        self.root = root
        self.venv = venv
        self.model = model
        self.c = Cluster(root, heartbeat="1s", lost_after="60s")
        self.agent_kw = vllm_agent(venv, pcie_box(root / "smi"))
        self.agent: Proc | None = None
        self.router: Proc | None = None
        self.router_url = ""
        self._client: openai.OpenAI | None = None

    # -- processes -------------------------------------------------------------
    def start_agent(self) -> Proc:
        self.agent = self.c.start_agent("cpu-1", **self.agent_kw)
        return self.agent

    def start_router(self) -> None:
        self.router, port = self.c.start_router(
            "edge", extra='metrics_interval = "250ms"\nmetrics_stale_after = "5s"\n')
        self.router_url = f"http://127.0.0.1:{port}"

    def deploy(self) -> None:
        self.c.apply("tiny", tiny_yaml(model=str(self.model), args=ENGINE_ARGS,
                                       extra=f"served_name: {MODEL}\n"))

    # -- what is running -------------------------------------------------------
    def replica(self) -> dict[str, Any]:
        return next(iter(self.c.replicas().values()), {})

    def wait_ready(self, timeout: float = READY_TIMEOUT, *, newer_than: int = 0) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            rep = self.replica()
            if rep.get("state") == "ready" and rep["generation"] > newer_than:
                return rep
            return None

        return wait_for(ready, timeout, f"vLLM replica ready (log: {self.engine_log()})",  # type: ignore[no-any-return]
                        interval=1.0)

    def engine_log(self) -> Path:
        return engine_log(self.root)

    def leader(self) -> int:
        """The engine's main process (its session leader): `vllm serve`'s API server."""
        found = leaders(self.root)
        assert len(found) == 1, found
        return found[0]

    def endpoint(self) -> str:
        return str(self.replica()["endpoint"])

    def client(self) -> openai.OpenAI:
        # One client, closed with the rig: a client left to the garbage collector leaks
        # its pooled sockets (a ResourceWarning, an error under filterwarnings).
        if self._client is None:
            self._client = openai.OpenAI(base_url=self.router_url + "/v1", api_key="none",
                                         timeout=60, max_retries=0)
        return self._client

    def wait_routed(self) -> None:
        """Until the router lists the model: it learns of a ready replica on its next poll
        of the server's table, up to `table_poll_interval` after ctl shows it ready (a
        request in between gets 503 model_not_ready, as it should)."""
        c = self.client()
        wait_for(lambda: MODEL in [m.id for m in c.models.list().data], 20, "router has the model")

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        self.c.close()


def metrics(url: str, timeout: float = 30) -> str:
    """The engine's /metrics, asked with its own key (issue 30)."""
    req = urllib.request.Request(url + "/metrics", headers=auth(url_key(url)))
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()



@pytest.fixture(scope="module")
def rig(vllm_venv: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    r = Rig(tmp_path_factory.mktemp("vllm-live"), vllm_venv, tiny_model)
    try:
        r.c.start_server()
        r.start_agent()
        r.c.wait_states({"cpu-1": "ready"})
        r.start_router()
        t0 = time.monotonic()
        r.deploy()
        r.wait_ready()
        print(f"vLLM ready under the agent in {time.monotonic() - t0:.0f}s")
        yield r
    finally:
        r.close()


def test_ready_and_served_through_the_router(rig: Rig) -> None:
    rep = rig.replica()
    assert rep["state"] == "ready" and rep["restarts"] == 0
    log = rig.engine_log().read_text(errors="replace")
    assert "SIMULATED" not in log and "vLLM" in log  # the real engine, not the simulation
    c = rig.client()
    rig.wait_routed()
    chat = c.chat.completions.create(model=MODEL, max_tokens=5,
                                     messages=[{"role": "user", "content": "hello"}])
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == "length" and chat.usage is not None
    assert chat.usage.completion_tokens == 5
    comp = c.completions.create(model=MODEL, prompt="The license", max_tokens=4)
    assert comp.choices[0].finish_reason == "length" and comp.usage is not None
    assert comp.usage.completion_tokens == 4

    chunks = list(c.chat.completions.create(
        model=MODEL, max_tokens=6, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hello"}]))
    # vLLM's shape: role first (empty content), content deltas, the last delta carries the
    # finish_reason, then a usage chunk with no choices.
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    with_choices = [ch for ch in chunks if ch.choices]
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    text = "".join(ch.choices[0].delta.content or "" for ch in with_choices)
    assert text


def test_load_watch_reads_the_engines_metrics(rig: Rig) -> None:
    text = metrics(rig.endpoint())
    # The names llmgw parses, exactly as the engine exports them (one of each kind).
    for kind, names in (("running", _RUNNING), ("waiting", _WAITING), ("kv usage", _USAGE)):
        present = [n for n in names if any(line.startswith(n + "{") for line in text.splitlines())]
        assert present, f"none of llmgw's {kind} names {names} in vLLM's /metrics"
    load = parse_load(text)
    assert load is not None
    assert load.running == series(text, "vllm:num_requests_running")
    # vllm:num_requests_waiting_by_reason sums to the waiting figure: it must not count twice.
    assert load.waiting == series(text, "vllm:num_requests_waiting")
    assert 0.0 <= load.kv_usage <= 1.0
    assert rig.router is not None
    router_log = rig.router.text()
    assert "no engine load figures" not in router_log
    assert "cannot read /metrics" not in router_log


def _send_stream(router_url: str) -> socket.socket:
    """A streamed completion of MAX_TOKENS sent through the router; nothing read yet."""
    host, port = router_url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": MAX_TOKENS,
                       "ignore_eos": True, "stream": True}).encode()
    s = socket.create_connection((host, int(port)), timeout=30)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
    except BaseException:
        s.close()
        raise
    return s


def _read_events(s: socket.socket, count: int) -> bytes:
    got = b""
    while got.count(b"data:") < count:
        chunk = s.recv(65536)
        assert chunk, got
        got += chunk
    return got


def _workers(leader: int) -> list[int]:
    """The engine's model workers (vLLM names them VLLM::Worker...), which run the forward
    passes: stopped, they freeze generation while the API server and EngineCore go on."""
    out = []
    for pid in procs.session_pids(leader):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith("VLLM::Worker"):
            out.append(pid)
    return out


def _settled(read: Any, what: str) -> float:
    """`read()` once two reads 0.3 s apart agree (the API server has drained what the
    EngineCore sent it)."""
    last: list[float] = []

    def same() -> bool:
        last.append(read())
        return len(last) >= 2 and last[-1] == last[-2]

    wait_for(same, 10, what, interval=0.3)
    return last[-1]


def test_client_disconnect_mid_stream_frees_the_engine_slot(rig: Rig) -> None:
    """A client that goes away mid-stream ends its generation on the engine.

    Made independent of how fast vLLM's CPU build streams: in CI, on two busy cores, the
    client's first chunks have come only after all 1,000 (then 8,000) tokens were made, so a
    close "after three chunks" was no longer mid-stream. Here the engine's own counter says
    when generation has begun; the model workers are then stopped (SIGSTOP) so it cannot run
    to its end while the client reads its first chunks and closes, and resumed (SIGCONT)
    after the close. Only a router that passes the close on to the engine keeps the count
    below MAX_TOKENS: one that kept the upstream stream open would let it run to the end.
    """
    url = rig.endpoint()
    workers = _workers(rig.leader())
    assert workers, f"no VLLM::Worker process in the engine's session (log: {rig.engine_log()})"
    gen = lambda: series(metrics(url), "vllm:generation_tokens_total")  # noqa: E731
    before = gen()
    s = _send_stream(rig.router_url)
    stopped = False
    try:
        begun = wait_for(lambda: gen() - before or None, 30, "the engine generating the stream",
                         interval=0.05)
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        stopped = True
        frozen = _settled(lambda: gen() - before, "the generation count settled")
        assert frozen < MAX_TOKENS, f"the engine made all {MAX_TOKENS} tokens before it was seen generating"
        # Mid-stream at the client: it has its first chunks (their tokens are made) when it goes.
        _read_events(s, 1)
    finally:
        s.close()
        closed = time.monotonic()
        if stopped:
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
    wait_for(lambda: series(metrics(url), "vllm:num_requests_running") == 0.0, 60,
             "vllm:num_requests_running back to 0", interval=0.2)
    freed = time.monotonic() - closed
    generated = gen() - before
    print(f"generating ({begun:.0f} tokens seen), frozen at {frozen:.0f}, aborted after "
          f"{generated:.0f} of {MAX_TOKENS} tokens, slot freed {freed:.2f}s after the close")
    assert generated < MAX_TOKENS, (generated, freed)


def test_agent_sigkill_engine_keeps_serving_and_is_adopted(rig: Rig) -> None:
    assert rig.agent is not None
    pid = rig.leader()
    session = sorted(procs.session_pids(pid))
    gen = rig.replica()["generation"]
    rig.agent.stop(signal.SIGKILL)
    rig.c.procs.remove(rig.agent)
    c = rig.client()
    # Serving goes on while the agent is away.
    r = c.chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].finish_reason == "length"
    rig.start_agent()
    rig.c.wait_states({"cpu-1": "ready"}, timeout=30)
    agent_log = rig.agent.text() if rig.agent else ""
    wait_for(lambda: "adopted" in (rig.agent.text() if rig.agent else ""), 30, "adoption logged")
    rep = rig.wait_ready(60)
    assert rep["generation"] == gen and rep["restarts"] == 0
    assert rig.leader() == pid and sorted(procs.session_pids(pid)) == session
    r = c.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    assert "Traceback" not in agent_log


def test_engine_sigkill_is_reported_and_restarted_under_a_new_generation(rig: Rig) -> None:
    pid = rig.leader()
    old = set(procs.session_pids(pid))
    assert len(old) >= 2  # vLLM's API server, EngineCore (and its worker)
    gen = rig.replica()["generation"]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: rig.replica().get("state") != "ready", 10, "replica no longer ready",
             interval=0.2)
    noticed = time.monotonic() - killed
    assert noticed < 5, noticed
    # The rest of its session is stopped, then the server restarts it after its backoff.
    wait_for(lambda: not any(procs.start_time(p) for p in old), 30, "old session gone")
    rep = rig.wait_ready(newer_than=gen)
    assert rep["generation"] > gen
    assert rig.leader() != pid
    rig.wait_routed()
    r = rig.client().chat.completions.create(model=MODEL, max_tokens=2,
                                             messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].finish_reason == "length"


def test_ctl_delete_leaves_no_process_of_the_engine_session(rig: Rig) -> None:
    pid = rig.leader()
    members = procs.session_pids(pid)
    assert len(members) >= 2
    r = rig.c.ctl("delete", "deployment", "tiny")
    assert r.returncode == 0, r.stderr
    wait_for(lambda: not procs.session_pids(pid), 60, f"session {pid} empty")
    assert not any(procs.start_time(p) for p in members)
    assert engine_pids(rig.root) == {}
    wait_for(lambda: not rig.replica(), 30, "replica gone from the server")
