from __future__ import annotations

import os
import socket
from pathlib import Path

import attrs
import pytest
import yaml
import zmq.auth

from llmgw.config.agent import AgentConfig, ModelDirConfig
from llmgw.config.load_agent import load_agent_config
from llmgw.errors import ConfigError

SHIPPED = Path(__file__).resolve().parents[2] / "conf" / "agent.yaml"
SHIPPED_TEXT = SHIPPED.read_text()
SECRET_LINE = "secret_key: /etc/llmgw/keys/gpu-a-01.key_secret"
SERVER_LINE = "server_key: /etc/llmgw/keys/server.key"
FABRIC = "hcas: [mlx5_0, mlx5_1, mlx5_2, mlx5_3]\n    rate_gbps: 200"


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    d.mkdir()
    zmq.auth.create_certificates(str(d), "server")
    zmq.auth.create_certificates(str(d), "gpu-a-01")
    return d


def write(tmp_path: Path, keys: Path, *edits: tuple[str, str]) -> str:
    text = SHIPPED_TEXT.replace(SECRET_LINE, f"secret_key: {keys / 'gpu-a-01.key_secret'}").replace(
        SERVER_LINE, f"server_key: {keys / 'server.key'}"
    )
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp_path / "agent.yaml"
    path.write_text(text)
    return str(path)


def test_shipped_config_loads(tmp_path: Path, keys: Path) -> None:
    cfg = load_agent_config(write(tmp_path, keys))
    assert cfg.node_id == "gpu-a-01"
    assert cfg.server == ("tcp://llmgw-server.internal:7443",)
    assert cfg.keys.secret_key == str(keys / "gpu-a-01.key_secret")
    assert cfg.mgmt_addr == "10.0.0.11"
    assert cfg.mgmt_interface == "eth0"
    assert cfg.labels == {"rack": "r12"}
    assert (cfg.heartbeat_interval, cfg.reconnect_base, cfg.reconnect_max) == (5.0, 1.0, 30.0)
    assert len(cfg.fabrics) == 1
    fab = cfg.fabrics[0]
    assert (fab.name, fab.hcas, fab.rate_gbps) == (
        "ib-a",
        ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"),
        200.0,
    )
    assert cfg.discovery.nvidia_smi == ""
    assert cfg.discovery.ib_root == "/sys/class/infiniband"
    assert cfg.discovery.prefer_nvml is True
    assert cfg.discovery.skip_gpus is False
    assert cfg.discovery.interval == 60.0
    assert cfg.model_dirs is None
    assert cfg.engines.vllm.bin == "/opt/venvs/vllm/bin/vllm"
    assert cfg.engines.vllm.launch_mode == "ray"
    assert cfg.engines.vllm.ray_bin == "/opt/venvs/vllm/bin/ray"
    assert cfg.engines.sglang.python == "/opt/venvs/sglang/bin/python"
    assert cfg.engines.simulated_python == ""
    sup = cfg.supervisor
    assert (sup.work_dir, sup.log_lines, sup.stop_timeout, sup.health_interval) == (
        "/var/lib/llmgw-agent",
        512,
        60.0,
        2.0,
    )
    assert sup.log_max_bytes == 64 * 1024 * 1024
    assert (sup.health_timeout, sup.startup_max, sup.release_timeout) == (10.0, 3600.0, 120.0)
    assert cfg.port_range == (20000, 29999)
    assert cfg.kv_relay_port == 7444
    assert cfg.source.endswith("agent.yaml")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cfg.node_id = "x"  # type: ignore[misc]


def test_shipped_config_keeps_every_seed_key() -> None:
    data = yaml.safe_load(SHIPPED_TEXT)
    assert data["server"].startswith("tcp://")
    assert "tls" not in data
    assert set(data["keys"]) == {"secret_key", "server_key"}
    assert data["keys"]["secret_key"] == "/etc/llmgw/keys/gpu-a-01.key_secret"
    assert data["keys"]["server_key"] == "/etc/llmgw/keys/server.key"
    for key in (
        "node_id",
        "mgmt_addr",
        "mgmt_interface",
        "labels",
        "heartbeat_interval",
        "reconnect_base",
        "reconnect_max",
        "fabrics",
        "discovery",
        "engines",
        "supervisor",
    ):
        assert key in data, key
    assert set(data["fabrics"][0]) == {"name", "hcas", "rate_gbps"}
    assert {"nvidia_smi", "ib_root", "prefer_nvml", "skip_gpus"} <= set(data["discovery"])
    assert set(data["engines"]["vllm"]) == {"bin", "launch_mode", "ray_bin"}
    assert set(data["engines"]["sglang"]) == {"python"}
    assert {"work_dir", "log_lines", "stop_timeout", "health_interval"} <= set(data["supervisor"])
    assert "# model_dirs:" in SHIPPED_TEXT  # documented, unset by default


def test_node_id_defaults_to_hostname(tmp_path: Path, keys: Path) -> None:
    cfg = load_agent_config(write(tmp_path, keys, ("node_id: gpu-a-01 # defaults to the hostname\n", "")))
    assert cfg.node_id == socket.gethostname()


def test_model_dirs_strings_and_mappings(tmp_path: Path, keys: Path) -> None:
    path = write(
        tmp_path,
        keys,
        ("# model_dirs:", "model_dirs:\n  - models\n  - {path: /mnt/w, shared: true, store: weka}\n#"),
    )
    cfg = load_agent_config(path)
    assert cfg.model_dirs == (
        ModelDirConfig(path="models"),
        ModelDirConfig(path="/mnt/w", shared=True, store="weka"),
    )


def test_relative_paths_kept_as_written(tmp_path: Path, keys: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = write(
        tmp_path,
        keys,
        (str(keys / "gpu-a-01.key_secret"), "keys/gpu-a-01.key_secret"),
        (str(keys / "server.key"), "./keys/server.key"),
        ("work_dir: /var/lib/llmgw-agent", "work_dir: state"),
    )
    cfg = load_agent_config(path)
    assert cfg.keys.secret_key == "keys/gpu-a-01.key_secret"
    assert cfg.keys.server_key == "./keys/server.key"
    assert cfg.supervisor.work_dir == "state"


@pytest.mark.parametrize(("written", "seconds"), [("5", 5.0), ("2.5", 2.5), ("500ms", 0.5), ("1m30s", 90.0)])
def test_durations(tmp_path: Path, keys: Path, written: str, seconds: float) -> None:
    cfg = load_agent_config(
        write(tmp_path, keys, ("heartbeat_interval: 5s", f"heartbeat_interval: {written}"))
    )
    assert cfg.heartbeat_interval == seconds


def test_empty_sections_mean_defaults(tmp_path: Path, keys: Path) -> None:
    path = write(tmp_path, keys, ("labels:\n  rack: r12\n", "labels:\n"))
    assert load_agent_config(path).labels == {}


# (id, edits, key path, a fragment the message must show: the bad value)
BAD: list[tuple[str, list[tuple[str, str]], str, str]] = [
    ("unknown top key", [("mgmt_interface: eth0", "mgmt_interface: eth0\ncolour: blue")], "colour", "blue"),
    (
        "unknown nested key",
        [("rate_gbps: 200", "rate_gbps: 200\n    hca: mlx5_9")],
        "fabrics[0].hca",
        "mlx5_9",
    ),
    (
        "unknown deep key",
        [("launch_mode: ray", "launch_mode: ray\n    binary: /x/vllm")],
        "engines.vllm.binary",
        "/x/vllm",
    ),
    (
        "tls block",
        [("mgmt_interface: eth0", "mgmt_interface: eth0\ntls:\n  ca: /etc/ca.pem")],
        "tls",
        "/etc/ca.pem",
    ),
    ("source is internal", [("mgmt_interface: eth0", "mgmt_interface: eth0\nsource: me")], "source", "me"),
    ("float wrong type", [("rate_gbps: 200", "rate_gbps: fast")], "fabrics[0].rate_gbps", "fast"),
    ("str wrong type", [("rack: r12", "rack: 12")], "labels.rack", "12"),
    (
        "bool wrong type",
        [("prefer_nvml: true", "prefer_nvml: sometimes")],
        "discovery.prefer_nvml",
        "sometimes",
    ),
    ("int wrong type", [("log_lines: 512", "log_lines: 51.2")], "supervisor.log_lines", "51.2"),
    ("int as string", [("log_lines: 512", "log_lines: '512'")], "supervisor.log_lines", "'512'"),
    ("hcas not a list", [(FABRIC, "hcas: mlx5_0")], "fabrics[0].hcas", "mlx5_0"),
    ("hca not a string", [(FABRIC, "hcas: [mlx5_0, 7]")], "fabrics[0].hcas[1]", "7"),
    ("section not a mapping", [("discovery:\n", "discovery: on_boot\nx:\n")], "discovery", "on_boot"),
    ("labels not a mapping", [("labels:\n  rack: r12", "labels: [r12]")], "labels", "r12"),
    (
        "bad duration",
        [("stop_timeout: 60s", "stop_timeout: 60 seconds")],
        "supervisor.stop_timeout",
        "60 seconds",
    ),
    (
        "duration without unit",
        [("heartbeat_interval: 5s", "heartbeat_interval: '5'")],
        "heartbeat_interval",
        "'5'",
    ),
    ("negative duration", [("reconnect_base: 1s", "reconnect_base: -1s")], "reconnect_base", "-1s"),
    ("zero duration", [("health_interval: 2s", "health_interval: 0s")], "supervisor.health_interval", "0s"),
    ("zero probe timeout", [("health_timeout: 10s", "health_timeout: 0s")], "supervisor.health_timeout", "0s"),
    ("bad release timeout", [("release_timeout: 2m", "release_timeout: 2 min")], "supervisor.release_timeout", "2 min"),
    (
        "startup cap below the interval",
        [("startup_max: 1h", "startup_max: 1s")],
        "supervisor.startup_max",
        "shorter than supervisor.health_interval",
    ),
    ("nested duration", [("  interval: 60s", "  interval: soon")], "discovery.interval", "soon"),
    ("reconnect max below base", [("reconnect_max: 30s", "reconnect_max: 500ms")], "reconnect_max", "0.5s"),
    ("missing server", [('server: "tcp://llmgw-server.internal:7443"\n', "")], "server", "missing"),
    ("missing mgmt_addr", [('mgmt_addr: "10.0.0.11"\n', "")], "mgmt_addr", "missing"),
    ("missing keys", [("keys:\n", "unused:\n")], "keys", "missing"),
    ("missing secret_key", [("  secret_key: ", "  # secret_key: ")], "keys.secret_key", "missing"),
    ("empty node_id", [("node_id: gpu-a-01", "node_id: ''")], "node_id", "''"),
    ("http server", [("tcp://llmgw", "http://llmgw")], "server", "http://llmgw-server"),
    ("https server", [("tcp://llmgw", "https://llmgw")], "server", "https://llmgw-server"),
    ("server without port", [("internal:7443", "internal")], "server", "tcp://llmgw-server.internal"),
    ("server port out of range", [("internal:7443", "internal:99999")], "server", "99999"),
    ("launch mode", [("launch_mode: ray", "launch_mode: slurm")], "engines.vllm.launch_mode", "slurm"),
    (
        "fabric without hcas",
        [(FABRIC, "hcas: [mlx5_0]\n  - name: ib-b\n    hcas: []")],
        "fabrics[1].hcas",
        "[]",
    ),
    (
        "fabric with null hcas",
        [(FABRIC, "hcas: [mlx5_0]\n  - name: ib-b\n    hcas:")],
        "fabrics[1].hcas",
        "[]",
    ),
    ("fabric missing hcas", [(FABRIC, "hcas: [mlx5_0]\n  - name: ib-b")], "fabrics[1].hcas", "missing"),
    (
        "two fabrics one name",
        [(FABRIC, "hcas: [mlx5_0]\n  - name: ib-a\n    hcas: [mlx5_1]")],
        "fabrics[1].name",
        "ib-a",
    ),
    (
        "hca in two fabrics",
        [(FABRIC, "hcas: [mlx5_0, mlx5_1]\n  - name: ib-b\n    hcas: [mlx5_2, mlx5_1]")],
        "fabrics[1].hcas",
        "mlx5_1",
    ),
    ("hca twice in one fabric", [(FABRIC, "hcas: [mlx5_0, mlx5_0]")], "fabrics[0].hcas", "mlx5_0"),
    (
        "port range inverted",
        [("port_range: [20000, 29999]", "port_range: [29999, 20000]")],
        "port_range",
        "[29999, 20000]",
    ),
    (
        "port range too high",
        [("port_range: [20000, 29999]", "port_range: [20000, 70000]")],
        "port_range",
        "70000",
    ),
    ("port range zero", [("port_range: [20000, 29999]", "port_range: [0, 100]")], "port_range", "[0, 100]"),
    ("port range length", [("port_range: [20000, 29999]", "port_range: [20000]")], "port_range", "[20000]"),
    ("kv relay port too high", [("kv_relay_port: 7444", "kv_relay_port: 70000")], "kv_relay_port", "70000"),
    ("kv relay port negative", [("kv_relay_port: 7444", "kv_relay_port: -1")], "kv_relay_port", "-1"),
    ("kv relay port a string", [("kv_relay_port: 7444", "kv_relay_port: lots")], "kv_relay_port", "lots"),
    (
        "kv relay port among the engines' ports",
        [("kv_relay_port: 7444", "kv_relay_port: 20001")],
        "kv_relay_port",
        "inside port_range [20000, 29999]",
    ),
    ("empty model_dirs", [("# model_dirs:", "model_dirs: []\n#")], "model_dirs", "[]"),
    ("null model_dirs", [("# model_dirs:", "model_dirs:\n#")], "model_dirs", "null"),
    ("model_dirs entry type", [("# model_dirs:", "model_dirs: [/a, 5]\n#")], "model_dirs[1]", "5"),
    (
        "model_dirs unknown key",
        [("# model_dirs:", "model_dirs: [{path: /a, kind: nfs}]\n#")],
        "model_dirs[0].kind",
        "nfs",
    ),
    (
        "model_dirs missing path",
        [("# model_dirs:", "model_dirs: [{shared: true}]\n#")],
        "model_dirs[0].path",
        "missing",
    ),
    (
        "model_dirs shared type",
        [("# model_dirs:", "model_dirs: [{path: /a, shared: maybe}]\n#")],
        "model_dirs[0].shared",
        "maybe",
    ),
    (
        "duplicate yaml key",
        [("stop_timeout: 60s", "stop_timeout: 60s\n  stop_timeout: 1s")],
        "",
        "stop_timeout",
    ),
]


@pytest.mark.parametrize(("edits", "key", "value"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config(tmp_path: Path, keys: Path, edits: list[tuple[str, str]], key: str, value: str) -> None:
    path = write(tmp_path, keys, *edits)
    with pytest.raises(ConfigError) as info:
        load_agent_config(path)
    err = info.value
    text = str(err)
    assert path in text
    assert err.key == key
    assert f": {key}: " in text if key else True
    assert value in text
    assert err.exit_code == 2


def _key_error(path: str, key: str, value: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_agent_config(path)
    text = str(info.value)
    assert path in text and f": {key}: " in text and value in text, text
    return text


def test_missing_secret_key_file(tmp_path: Path, keys: Path) -> None:
    (keys / "gpu-a-01.key_secret").unlink()
    path = write(tmp_path, keys)
    text = _key_error(path, "keys.secret_key", str(keys / "gpu-a-01.key_secret"))
    assert "llmgw keys issue node" in text


def test_missing_server_key_file(tmp_path: Path, keys: Path) -> None:
    (keys / "server.key").unlink()
    _key_error(write(tmp_path, keys), "keys.server_key", str(keys / "server.key"))


def test_secret_key_that_is_public(tmp_path: Path, keys: Path) -> None:
    public = str(keys / "gpu-a-01.key")
    path = write(tmp_path, keys, (str(keys / "gpu-a-01.key_secret"), public))
    assert "only a public key" in _key_error(path, "keys.secret_key", public)


def test_key_file_not_a_certificate(tmp_path: Path, keys: Path) -> None:
    (keys / "server.key").write_text("hello\n")
    assert "not a zmq certificate" in _key_error(
        write(tmp_path, keys), "keys.server_key", str(keys / "server.key")
    )


def test_key_file_malformed_key(tmp_path: Path, keys: Path) -> None:
    (keys / "server.key").write_text('curve\n    public-key = "tooshort"\n')
    _key_error(write(tmp_path, keys), "keys.server_key", str(keys / "server.key"))


def test_key_file_is_directory(tmp_path: Path, keys: Path) -> None:
    path = write(tmp_path, keys, (str(keys / "server.key"), str(keys)))
    _key_error(path, "keys.server_key", str(keys))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_key_file_unreadable(tmp_path: Path, keys: Path) -> None:
    secret = keys / "gpu-a-01.key_secret"
    secret.chmod(0)
    try:
        _key_error(write(tmp_path, keys), "keys.secret_key", str(secret))
    finally:
        secret.chmod(0o600)


def test_yaml_syntax_error_names_line(tmp_path: Path, keys: Path) -> None:
    path = write(tmp_path, keys, ('mgmt_addr: "10.0.0.11"', "mgmt_addr: [10.0.0.11"))
    with pytest.raises(ConfigError) as info:
        load_agent_config(path)
    assert path in str(info.value)
    assert "line " in str(info.value)


def test_file_missing(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="no such file") as info:
        load_agent_config(path)
    assert path in str(info.value)


def test_file_is_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_agent_config(str(tmp_path))
    assert str(tmp_path) in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_file_unreadable(tmp_path: Path, keys: Path) -> None:
    path = write(tmp_path, keys)
    os.chmod(path, 0)
    try:
        with pytest.raises(ConfigError, match="cannot read") as info:
            load_agent_config(path)
        assert path in str(info.value)
    finally:
        os.chmod(path, 0o600)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_top_level_not_a_mapping(tmp_path: Path, text: str) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="top level must be a mapping") as info:
        load_agent_config(str(path))
    assert str(path) in str(info.value)


def test_several_errors_are_counted(tmp_path: Path, keys: Path) -> None:
    path = write(
        tmp_path,
        keys,
        ("rate_gbps: 200", "rate_gbps: fast"),
        ("log_lines: 512", "log_lines: many"),
    )
    with pytest.raises(ConfigError) as info:
        load_agent_config(path)
    assert "fabrics[0].rate_gbps" in str(info.value)
    assert "supervisor.log_lines" in str(info.value)


def test_config_shape_is_frozen_attrs() -> None:
    assert attrs.has(AgentConfig)
    assert AgentConfig.__attrs_attrs__  # type: ignore[attr-defined]


def test_server_may_be_a_list(tmp_path: Path, keys: Path) -> None:
    path = write(tmp_path, keys)
    text = Path(path).read_text()
    line = next(x for x in text.splitlines() if x.startswith("server:"))
    Path(path).write_text(text.replace(line, 'server: ["tcp://a:7443", "tcp://b:7443"]'))
    assert load_agent_config(path).server == ("tcp://a:7443", "tcp://b:7443")
    for bad, why in [("[]", "non-empty list"), ('["tcp://a:1", "tcp://a:1"]', "twice"),
                     ('["tcp://a:1", "http://b:1"]', "HTTP address")]:
        Path(path).write_text(text.replace(line, f"server: {bad}"))
        with pytest.raises(ConfigError, match=why):
            load_agent_config(path)


def test_kv_relay_port_zero_means_no_relay_and_absent_means_the_default(tmp_path: Path, keys: Path) -> None:
    assert load_agent_config(write(tmp_path, keys, ("kv_relay_port: 7444", "kv_relay_port: 0"))).kv_relay_port == 0
    assert load_agent_config(write(tmp_path, keys, ("kv_relay_port: 7444", "# kv_relay_port"))).kv_relay_port == 7444
