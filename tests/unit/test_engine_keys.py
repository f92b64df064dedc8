"""Issue 30 item 2: every engine's own API key, in the plans, on disk, on the wire, in
the router's table, in llmgw's guard and in the simulated engine's copy of the engines'
rules (the live tests run them together: tests/integration/test_engine_keys_live.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.engines import keys
from llmgw.agent.lifecycle.records import EngineRecord, new_key, read_records, write_record
from llmgw.agent.process.spawn import default_plan, spawn_plan
from llmgw.config.agent import AgentConfig, EnginesConfig, KeysConfig, SglangConfig, VllmConfig
from llmgw.errors import EngineError, ProtocolError, UsageError
from llmgw.model.engine import EngineKind, EngineReport, EngineSpec, EngineState, GangSpec
from llmgw.router.routing.table import EndpointTable
from llmgw.server.endpoints import without_keys
from llmgw.simengine.args import parse_args
from llmgw.simengine.auth import KeyCheck, refused
from llmgw.transport import codec, messages
from llmgw.transport.codec import structure_result
from llmgw.transport.requests import EndpointsResult

IDX = {"GPU-a": 0, "GPU-b": 1}


def config(mode: str = "mp") -> AgentConfig:
    return AgentConfig(
        node_id="n1", server="tcp://10.0.0.9:5555", keys=KeysConfig("s", "p"), mgmt_addr="10.0.0.2",
        engines=EnginesConfig(vllm=VllmConfig(bin="/opt/vllm/bin/vllm", launch_mode=mode,
                                              ray_bin="/opt/vllm/bin/ray"),
                              sglang=SglangConfig(python="/opt/sglang/bin/python"),
                              simulated_python="/usr/bin/python3"),
    )


def spec(kind: EngineKind = EngineKind.VLLM, rank: int | None = None, **kw: Any) -> EngineSpec:
    gang = None if rank is None else GangSpec(nnodes=2, rank=rank, head_addr="10.0.0.1",
                                              rendezvous_port=29600, ray_port=26379,
                                              ray_port_base=27000)
    base = EngineSpec(replica_id="r1", generation=1, deployment="d", model="org/m", served_name="m",
                      engine=kind, gpus=("GPU-a", "GPU-b"), port=20001, tensor_parallel=2, gang=gang)
    return attrs.evolve(base, **kw)


def plan_of(s: EngineSpec, mode: str = "mp", work: str = "/w") -> Any:
    cfg = attrs.evolve(config(mode), supervisor=attrs.evolve(config().supervisor, work_dir=work))
    return default_plan(cfg, "/usr/bin/python3")(s, IDX)


# ---- launch plans ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", [EngineKind.VLLM, EngineKind.SIMULATED])
@pytest.mark.parametrize(("rank", "mode"), [(None, "mp"), (0, "mp"), (0, "ray")])
def test_a_vllm_api_server_gets_the_guard_and_its_key_by_environment(
        kind: EngineKind, rank: int | None, mode: str) -> None:
    plan = plan_of(spec(kind, rank), mode)
    main = plan.main
    assert main.argv[-2:] == ("--middleware", "llmgw_engine_guard.EngineKeyGuard")
    assert main.env["PYTHONPATH"] == keys.GUARD_DIR
    assert (Path(keys.GUARD_DIR) / "llmgw_engine_guard.py").is_file()
    assert plan.api_key_env == "VLLM_API_KEY" and plan.api_key_file == ""
    # The plan holds no key: the spawn adds it (never in argv, never in a plan's log line).
    assert "VLLM_API_KEY" not in main.env
    assert not any(a.startswith("llmgw-") for p in plan.processes for a in p.argv)


@pytest.mark.parametrize(("kind", "mode"), [(EngineKind.VLLM, "mp"), (EngineKind.VLLM, "ray"),
                                            (EngineKind.SIMULATED, "mp"), (EngineKind.SGLANG, "mp")])
def test_members_that_serve_no_api_get_no_key(kind: EngineKind, mode: str) -> None:
    plan = plan_of(spec(kind, 1), mode)
    assert (plan.api_key_env, plan.api_key_file) == ("", "")
    assert "--middleware" not in plan.main.argv and "--config" not in plan.main.argv


@pytest.mark.parametrize("rank", [None, 0])
def test_sglang_gets_its_key_in_a_config_file_never_in_argv(rank: int | None) -> None:
    plan = plan_of(spec(EngineKind.SGLANG, rank))
    path = "/w/engines/r1/llmgw-engine-key.yaml"
    assert plan.main.argv[-2:] == ("--config", path)
    assert plan.api_key_file == path and plan.api_key_env == ""
    assert keys.sglang_key_config("llmgw-abc_-9") == 'api-key: "llmgw-abc_-9"\n'


def test_a_deployments_own_pythonpath_comes_after_the_guard() -> None:
    plan = plan_of(spec(env={"PYTHONPATH": "/opt/mine"}))
    assert plan.main.env["PYTHONPATH"] == keys.GUARD_DIR + ":/opt/mine"


@pytest.mark.parametrize(("kind", "arg"), [(EngineKind.VLLM, "--api-key"), (EngineKind.VLLM, "--api-key=x"),
                                           (EngineKind.SGLANG, "--api-key"), (EngineKind.SGLANG, "--config")])
def test_a_deployment_that_sets_its_own_key_is_refused_with_a_reason(kind: EngineKind, arg: str) -> None:
    with pytest.raises(EngineError, match="API key of its own"):
        plan_of(spec(kind, args=(arg, "x")))


@pytest.mark.parametrize("args", [("--tokenizer-worker-num", "4"), ("--tokenizer-worker-num=2",),
                                  ("--grpc-port", "30001")])
def test_sglang_options_that_take_no_key_are_refused_with_a_reason(args: tuple[str, ...]) -> None:
    with pytest.raises(EngineError, match="takes no API key"):
        plan_of(spec(EngineKind.SGLANG, args=args))
    plan_of(spec(EngineKind.SGLANG, args=("--tokenizer-worker-num", "1")))  # one: fine


# ---- the key on disk, and at spawn -----------------------------------------------------


def test_new_keys_are_fresh_header_safe_and_start_with_a_letter() -> None:
    made = {new_key() for _ in range(50)}
    assert len(made) == 50
    for k in made:
        assert k[0].isalpha() and len(k) > 40
        assert codec.decode(codec.encode(messages.EngineChanged(
            EngineReport("r", 1, EngineState.READY, api_key=k)))).report.api_key == k  # type: ignore[attr-defined]


def test_the_record_keeps_the_key_readable_by_its_user_only(tmp_path: Path) -> None:
    rec = EngineRecord(spec=spec(), log_path="/x/engine.log", api_key="llmgw-secret")
    # A temporary file a crash left behind, world-readable: the write still ends at 0600.
    folder = tmp_path / "engines" / "r1"
    folder.mkdir(parents=True)
    (folder / "record.json.tmp").write_text("{}")
    os.chmod(folder / "record.json.tmp", 0o644)
    write_record(str(tmp_path), rec)
    mode = stat.S_IMODE(os.stat(folder / "record.json").st_mode)
    assert mode == 0o600
    (back,) = read_records(str(tmp_path))
    assert back.api_key == "llmgw-secret"
    assert "llmgw-secret" not in repr(back)


def test_spawn_puts_the_key_in_the_engines_environment_and_its_file(tmp_path: Path) -> None:
    script = ("import os,sys; print('KEY=' + os.environ.get('VLLM_API_KEY', '')); "
              "print('ARGV=' + ' '.join(sys.argv[1:]))")
    from llmgw.agent.engines.plan import LaunchPlan, ProcessPlan
    plan = LaunchPlan((ProcessPlan("engine", (sys.executable, "-c", script, "a"), {}, str(tmp_path)),),
                      api_key_env="VLLM_API_KEY", api_key_file=str(tmp_path / "k.yaml"))
    log = tmp_path / "engine.log"
    pid = spawn_plan(plan, str(tmp_path), str(log), "r1", "llmgw-sekrit")
    deadline = time.monotonic() + 20
    while "KEY=" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    os.waitpid(pid, 0)
    text = log.read_text()
    assert "KEY=llmgw-sekrit" in text and "ARGV=a" in text
    assert (tmp_path / "k.yaml").read_text() == 'api-key: "llmgw-sekrit"\n'
    assert stat.S_IMODE(os.stat(tmp_path / "k.yaml").st_mode) == 0o600


def test_a_launchers_plan_file_is_private_and_only_the_engine_gets_the_key(tmp_path: Path) -> None:
    from llmgw.agent.engines.plan import LaunchPlan, ProcessPlan
    pre = ProcessPlan("ray-head", (sys.executable, "-c", "pass"), {}, str(tmp_path))
    main = ProcessPlan("engine", (sys.executable, "-c", "pass"), {}, str(tmp_path))
    plan = LaunchPlan((pre, main), api_key_env="VLLM_API_KEY")
    pid = spawn_plan(plan, str(tmp_path), str(tmp_path / "engine.log"), "r1", "llmgw-sekrit")
    os.waitpid(pid, 0)
    doc = tmp_path / "plan.json"
    assert stat.S_IMODE(os.stat(doc).st_mode) == 0o600
    written = json.loads(doc.read_text())
    assert written["main"]["env"]["VLLM_API_KEY"] == "llmgw-sekrit"
    assert written["pre"][0]["env"].get("VLLM_API_KEY") != "llmgw-sekrit"


# ---- on the wire, the server's table, the router's -------------------------------------


@pytest.mark.parametrize("bad", ["a\r\nx-evil: 1", "k" * 129, "sp ace", "é"])
def test_a_report_or_a_table_with_a_key_no_header_may_carry_is_refused(bad: str) -> None:
    raw = codec.converter.unstructure(messages.EngineChanged(EngineReport("r", 1, EngineState.READY)),
                                      messages.Message)
    raw["report"]["api_key"] = bad
    with pytest.raises(ProtocolError):
        codec.decode(msgpack.packb(raw))
    snap = {"version": 1, "models": {"m": [{"replica_id": "r", "url": "http://h:1", "key": bad}]}}
    with pytest.raises(ProtocolError):
        structure_result(snap, EndpointsResult)


@given(st.one_of(st.text(max_size=200), st.integers(-(2**63), 2**63 - 1), st.none(),
                 st.binary(max_size=20)))
def test_any_key_a_peer_sends_is_a_header_safe_key_or_a_protocol_error(value: object) -> None:
    raw = codec.converter.unstructure(messages.EngineChanged(EngineReport("r", 1, EngineState.READY)),
                                      messages.Message)
    raw["report"]["api_key"] = value
    try:
        msg = codec.decode(msgpack.packb(raw, use_bin_type=True))
    except ProtocolError:
        return
    key = msg.report.api_key  # type: ignore[attr-defined]
    assert isinstance(key, str) and len(key) <= 128 and not set(key) & set("\r\n :")


def test_a_report_without_a_key_is_on_the_wire_as_before() -> None:
    data = codec.encode(messages.EngineChanged(EngineReport("r", 1, EngineState.READY)))
    assert b"api_key" not in data


def test_the_router_sends_the_engines_key_and_admins_never_see_it() -> None:
    table = {"models": {"m": [{"replica_id": "r1", "url": "http://h:1", "ready": True, "key": "llmgw-k"},
                              {"replica_id": "r2", "url": "http://h:2", "ready": True}]}, "waiting": {}}
    t = EndpointTable()
    t.apply({"version": 1, **table})
    assert t.replicas["r1"].auth == b"authorization: Bearer llmgw-k\r\n"
    assert t.replicas["r2"].auth == b""
    t.apply({"version": 2, "models": {"m": [{"replica_id": "r1", "url": "http://h:1"}]}})
    assert t.replicas["r1"].auth == b""  # an engine restarted without one: none sent
    assert "key" not in without_keys(table)["models"]["m"][0]
    assert table["models"]["m"][0]["key"] == "llmgw-k"  # the router's copy untouched


# ---- llmgw's guard, as vLLM runs it ----------------------------------------------------


def guard_module() -> ModuleType:
    path = Path(keys.GUARD_DIR) / "llmgw_engine_guard.py"
    spec_ = importlib.util.spec_from_file_location("llmgw_engine_guard", path)
    assert spec_ is not None and spec_.loader is not None
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    return mod


async def through_guard(monkeypatch: pytest.MonkeyPatch, method: str, path: str,
                        auth: bytes | None, kind: str = "http") -> tuple[int, bool]:
    monkeypatch.setenv("VLLM_API_KEY", "llmgw-good")
    reached = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    sent: list[dict[str, Any]] = []

    async def send(msg: Any) -> None:
        sent.append(msg)

    async def receive() -> Any:
        return {"type": "http.request", "body": b""}

    headers = [(b"host", b"x")] + ([(b"authorization", auth)] if auth is not None else [])
    guard = guard_module().EngineKeyGuard(app)
    await guard({"type": kind, "method": method, "path": path, "root_path": "", "headers": headers},
                receive, send)
    status = sent[0].get("status", 0) if sent[0]["type"] != "websocket.close" else 403
    return status, bool(reached)


DEV_PATHS = ["/metrics", "/sleep", "/wake_up", "/is_sleeping", "/collective_rpc", "/reset_prefix_cache",
             "/server_info", "/invocations", "/v1/models", "/v1/load_lora_adapter", "/ping", "/"]


@pytest.mark.parametrize("path", DEV_PATHS)
async def test_the_guard_refuses_every_path_but_health_without_the_key(
        monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    assert await through_guard(monkeypatch, "POST", path, None) == (401, False)
    assert await through_guard(monkeypatch, "GET", path, b"Bearer llmgw-bad") == (401, False)
    assert await through_guard(monkeypatch, "GET", path, b"Basic llmgw-good") == (401, False)
    assert await through_guard(monkeypatch, "POST", path, b"Bearer llmgw-good") == (200, True)
    assert await through_guard(monkeypatch, "POST", path, b"bearer llmgw-good") == (200, True)


async def test_the_guard_leaves_health_open_and_closes_websockets(monkeypatch: pytest.MonkeyPatch) -> None:
    assert await through_guard(monkeypatch, "GET", "/health", None) == (200, True)
    assert await through_guard(monkeypatch, "POST", "/health", None) == (401, False)
    assert await through_guard(monkeypatch, "GET", "/v1/realtime", None, "websocket") == (403, False)


def test_the_guard_will_not_start_without_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is not set"):
        guard_module().EngineKeyGuard(lambda *a: None)


# ---- the simulated engine: the same answers --------------------------------------------

GUARDED = KeyCheck("vllm", vllm_keys=("k",), guard_key="k")


@pytest.mark.parametrize("path", DEV_PATHS)
def test_the_simulated_engine_refuses_as_vllm_under_the_guard(path: str) -> None:
    assert refused(GUARDED, "GET", path, None)
    assert refused(GUARDED, "GET", path, "Bearer x")
    assert not refused(GUARDED, "GET", path, "Bearer k")
    assert not refused(GUARDED, "GET", "/health", None)


def test_the_simulated_engine_refuses_as_vllm_and_sglang_do_on_their_own() -> None:
    own = KeyCheck("vllm", vllm_keys=("k",))  # vLLM's --api-key alone: /v1 and friends only
    assert refused(own, "POST", "/v1/chat/completions", None)
    assert not refused(own, "POST", "/sleep", None) and not refused(own, "GET", "/metrics", None)
    sg = KeyCheck("sglang", sglang_key="k")
    for path in ("/health", "/health_generate", "/ready", "/metrics"):
        assert not refused(sg, "GET", path, None)
    for path in ("/v1/models", "/flush_cache", "/update_weights_from_disk", "/server_info"):
        assert refused(sg, "POST", path, None) and not refused(sg, "POST", path, "Bearer k")
    assert not refused(KeyCheck(), "POST", "/sleep", None)


def test_the_simulated_engine_takes_its_key_as_the_engines_do(tmp_path: Path) -> None:
    guard = ("--middleware", "llmgw_engine_guard.EngineKeyGuard")
    args = parse_args(["serve", "m", *guard], {"VLLM_API_KEY": "k"})
    assert args.keys == GUARDED
    assert parse_args(["serve", "m", "--api-key", "a", "b"], {"VLLM_API_KEY": "k"}).keys.vllm_keys == ("a", "b")
    with pytest.raises(UsageError, match="VLLM_API_KEY is not set"):
        parse_args(["serve", "m", *guard], {})
    f = tmp_path / "k.yaml"
    f.write_text(keys.sglang_key_config("llmgw-x"))
    sg = parse_args(["--model-path", "m", "--config", str(f)], {})
    assert sg.keys == KeyCheck("sglang", sglang_key="llmgw-x")
    f.write_text('api_key: "llmgw-x"\n')  # SGLang: "unrecognized arguments: --api_key"
    with pytest.raises(UsageError, match="--api_key"):
        parse_args(["--model-path", "m", "--config", str(f)], {})
