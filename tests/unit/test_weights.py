"""Which weights an engine loads (issue 23): a copy the node's scan found, by path, or a
download into download_dir; the config key. (That the core stays pure is
tests/unit/test_architecture.py's.)"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import zmq.auth
from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.discovery.storage import scan_storage
from llmgw.agent.engines.weights import (
    HF_CACHE_ENV,
    HF_OFFLINE_ENV,
    Weights,
    download_dir_of,
    hf_cache_of,
    resolve_weights,
    weights_for,
)
from llmgw.config.agent import AgentConfig, EnginesConfig, KeysConfig, ModelDirConfig, VllmConfig
from llmgw.config.load_agent import load_agent_config
from llmgw.errors import ConfigError, EngineError
from llmgw.model.engine import EngineKind, EngineSpec, GangSpec
from llmgw.model.inventory import ModelCopy, StorageReport

SNAP = "/hf/models--org--tiny/snapshots/0123abcd"
PLAIN = ModelCopy("org/tiny", "/data/models/org/tiny", 5 << 20, True)
HF = ModelCopy("org/tiny", SNAP, 5 << 20, True, shared=True, store="weka-a")


def _write_model(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x" * 64)


def test_plain_tree_by_path() -> None:
    w = resolve_weights("org/tiny", StorageReport(True, (PLAIN,)), "/dl")
    assert w == Weights(arg=PLAIN.path, env={}, copy=PLAIN,
                        reason="org/tiny: local plain tree /data/models/org/tiny")


def test_hf_cache_by_snapshot_path_with_cache_and_offline() -> None:
    w = resolve_weights("org/tiny", StorageReport(True, (HF,)), "/dl")
    assert w.arg == SNAP and w.copy == HF and w.download_dir == ""
    assert w.env == {HF_CACHE_ENV: "/hf", HF_OFFLINE_ENV: "1"}
    assert w.reason == f"org/tiny: shared HF cache {SNAP} (store weka-a)"


def test_nothing_held_downloads_into_download_dir() -> None:
    w = resolve_weights("org/tiny", StorageReport(True, ()), "/var/lib/llmgw-models")
    assert w == Weights(arg="org/tiny", env={HF_CACHE_ENV: "/var/lib/llmgw-models"},
                        reason="org/tiny: no copy on this node; downloading into /var/lib/llmgw-models",
                        download_dir="/var/lib/llmgw-models")


def test_nothing_held_and_no_download_dir_is_todays_behaviour() -> None:
    for storage in (None, StorageReport(False), StorageReport(True, ())):
        w = resolve_weights("org/tiny", storage, "")
        assert (w.arg, w.env, w.copy, w.download_dir) == ("org/tiny", {}, None, "")
        assert "own cache" in w.reason


def test_incomplete_copy_is_never_used() -> None:
    half = attrs.evolve(PLAIN, complete=False, reason="partial download: model.safetensors.part")
    w = resolve_weights("org/tiny", StorageReport(True, (half,)), "/dl")
    assert w.arg == "org/tiny" and w.download_dir == "/dl" and w.copy is None
    assert "incomplete (partial download: model.safetensors.part)" in w.reason


def test_local_before_shared_then_scan_order() -> None:
    other = attrs.evolve(PLAIN, path="/other/org/tiny")
    storage = StorageReport(True, (HF, PLAIN, other))
    assert resolve_weights("org/tiny", storage, "").copy == PLAIN
    assert resolve_weights("org/tiny", StorageReport(True, (HF, other, PLAIN)), "").copy == other


def test_name_must_match_exactly() -> None:
    storage = StorageReport(True, (attrs.evolve(PLAIN, name="tiny"), attrs.evolve(PLAIN, name="org/tiny2")))
    assert resolve_weights("org/tiny", storage, "").copy is None


def test_path_as_written_names_the_copy_it_is() -> None:
    w = resolve_weights("/data/models/org/tiny/", StorageReport(True, (PLAIN,)), "/dl")
    assert (w.arg, w.env, w.copy, w.download_dir) == ("/data/models/org/tiny/", {}, PLAIN, "")
    w = resolve_weights("/elsewhere/m", StorageReport(True, (PLAIN,)), "/dl")
    assert (w.arg, w.copy, w.download_dir) == ("/elsewhere/m", None, "")


def test_shared_only_skips_a_local_copy() -> None:
    w = resolve_weights("org/tiny", StorageReport(True, (PLAIN,)), "/dl", shared_only=True)
    assert w.arg == "org/tiny" and w.download_dir == "/dl" and "Ray gang" in w.reason
    assert resolve_weights("org/tiny", StorageReport(True, (PLAIN, HF)), "", shared_only=True).copy == HF


def test_download_refused_when_the_known_size_does_not_fit() -> None:
    empty = StorageReport(True, ())
    with pytest.raises(EngineError, match=r"download_dir /dl has 1\.0 GiB free for its 2\.0 GiB"):
        resolve_weights("org/tiny", empty, "/dl", need_bytes=2 << 30, free_bytes=1 << 30)
    # Unknown size or unknown free space: not checked (the agent knows neither today).
    assert resolve_weights("org/tiny", empty, "/dl", need_bytes=0, free_bytes=0).download_dir == "/dl"
    assert resolve_weights("org/tiny", empty, "/dl", need_bytes=2 << 30).download_dir == "/dl"


def test_hf_cache_of() -> None:
    assert hf_cache_of(SNAP) == "/hf"
    assert hf_cache_of(SNAP + "/") == "/hf"
    assert hf_cache_of("/data/models/org/tiny") == ""
    assert hf_cache_of("/x/snapshots/abc") == ""  # no models-- repo above it


@given(st.text(max_size=80))
def test_hf_cache_of_is_total(path: str) -> None:
    assert isinstance(hf_cache_of(path), str)


def test_on_what_the_real_scan_reports(tmp_path: Path) -> None:
    """The layouts as scan_storage reports them: a plain tree's path, an HF cache's
    snapshot (refs/main) under the cache folder."""
    plain, cache = tmp_path / "plain", tmp_path / "hub"
    _write_model(plain / "org" / "tiny")
    repo = cache / "models--org--tiny"
    _write_model(repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    for top, arg, env in ((plain, str(plain / "org" / "tiny"), {}),
                          (cache, str(repo / "snapshots" / "abc123"),
                           {HF_CACHE_ENV: str(cache), HF_OFFLINE_ENV: "1"})):
        report = scan_storage((ModelDirConfig(str(top)),), []).report
        w = resolve_weights("org/tiny", report, "/dl")
        assert (w.arg, w.env) == (arg, env)


def _config(**kw: object) -> AgentConfig:
    return AgentConfig(node_id="n1", server="tcp://10.0.0.9:5555", keys=KeysConfig("s", "p"),
                       mgmt_addr="10.0.0.2", **kw)  # type: ignore[arg-type]


def test_download_dir_of() -> None:
    dirs = (ModelDirConfig("/a"), ModelDirConfig("/b"))
    assert download_dir_of(_config()) == ""
    assert download_dir_of(_config(model_dirs=dirs)) == "/a"
    assert download_dir_of(_config(model_dirs=dirs, download_dir="/b")) == "/b"
    assert download_dir_of(_config(model_dirs=dirs, download_dir="")) == ""


def test_weights_for_ray_gang_takes_only_shared_copies() -> None:
    spec = EngineSpec("r1", 1, "d", "org/tiny", "tiny", EngineKind.VLLM, (), 20000,
                      gang=GangSpec(2, 0, "10.0.0.1", 29600, ray_port=1, ray_port_base=2))
    storage = StorageReport(True, (PLAIN,))
    ray = _config(engines=EnginesConfig(vllm=VllmConfig(launch_mode="ray")))
    mp = _config(engines=EnginesConfig(vllm=VllmConfig(launch_mode="mp")))
    assert weights_for(spec, ray, storage).copy is None
    assert weights_for(spec, mp, storage).copy == PLAIN
    one = attrs.evolve(spec, gang=None)
    assert weights_for(one, ray, storage).copy == PLAIN


def _agent_yaml(tmp_path: Path, extra: str) -> str:
    keys = tmp_path / "keys"
    if not keys.exists():
        keys.mkdir()
        zmq.auth.create_certificates(str(keys), "server")
        zmq.auth.create_certificates(str(keys), "n1")
    doc = {"secret_key": str(keys / "n1.key_secret"), "server_key": str(keys / "server.key")}
    path = tmp_path / "agent.yaml"
    path.write_text("node_id: n1\nserver: tcp://10.0.0.9:5555\nmgmt_addr: 10.0.0.2\n"
                    f"keys: {json.dumps(doc)}\n" + extra)
    return str(path)


def test_load_defaults_download_dir_to_first_writable_model_dir(tmp_path: Path) -> None:
    missing, rw = tmp_path / "not-mounted", tmp_path / "rw"
    rw.mkdir()
    cfg = load_agent_config(_agent_yaml(tmp_path, f"model_dirs: [{missing}, {rw}]\n"))
    assert cfg.download_dir == str(rw)
    none = load_agent_config(_agent_yaml(tmp_path, f"model_dirs: [{missing}]\n"))
    assert none.download_dir == ""


def test_load_download_dir_key(tmp_path: Path) -> None:
    assert load_agent_config(_agent_yaml(tmp_path, "")).download_dir == ""
    cfg = load_agent_config(_agent_yaml(tmp_path, f"model_dirs: [{tmp_path}]\ndownload_dir: /dl\n"))
    assert cfg.download_dir == "/dl"
    assert load_agent_config(_agent_yaml(tmp_path, 'download_dir: ""\n')).download_dir == ""
    with pytest.raises(ConfigError, match="download_dir"):
        load_agent_config(_agent_yaml(tmp_path, 'download_dir: "  "\n'))
    with pytest.raises(ConfigError, match="download_dir"):
        load_agent_config(_agent_yaml(tmp_path, "download_dir: [1]\n"))
