"""router.toml's kv_aware keys: loaded, defaulted, and refused with the file, the key and
the value (exit 2) where they make no sense."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq.auth

from llmgw.config.load_router import load_router_config
from llmgw.config.router import ModelRouteConfig
from llmgw.errors import ConfigError

BASE = """server = "tcp://127.0.0.1:7443"
[keys]
secret_key = "{keys}/router-1.key_secret"
server_key = "{keys}/server.key"
"""


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    d.mkdir()
    zmq.auth.create_certificates(str(d), "server")
    zmq.auth.create_certificates(str(d), "router-1")
    return d


def write(tmp_path: Path, keys: Path, models: str) -> str:
    path = tmp_path / "router.toml"
    path.write_text(BASE.format(keys=keys) + models)
    return str(path)


def test_kv_aware_loads_with_its_defaults(tmp_path: Path, keys: Path) -> None:
    cfg = load_router_config(write(tmp_path, keys, '[models.m]\npolicy = "kv_aware"\ntokenizer = "/models/m"\n'))
    m = cfg.models["m"]
    assert m == ModelRouteConfig(policy="kv_aware", tokenizer="/models/m")
    assert (m.kv_weight, m.kv_speculative_ttl, m.kv_index_blocks) == (0.1, 2.0, 100_000)


def test_kv_aware_keys_as_written(tmp_path: Path, keys: Path) -> None:
    cfg = load_router_config(write(tmp_path, keys, (
        '[models.m]\npolicy = "kv_aware"\ntokenizer = "/t"\nkv_weight = 2\n'
        'kv_speculative_ttl = "500ms"\nkv_index_blocks = 4096\n')))
    m = cfg.models["m"]
    assert (m.kv_weight, m.kv_speculative_ttl, m.kv_index_blocks) == (2.0, 0.5, 4096)


BAD = [
    ("no tokenizer", 'policy = "kv_aware"', "tokenizer", "tokenizer folder"),
    ("tokenizer elsewhere", 'policy = "prefix_affinity"\ntokenizer = "/t"', "tokenizer", "prefix_affinity"),
    ("negative weight", 'policy = "kv_aware"\ntokenizer = "/t"\nkv_weight = -1', "kv_weight", "-1"),
    ("nan weight", 'policy = "kv_aware"\ntokenizer = "/t"\nkv_weight = nan', "kv_weight", "nan"),
    ("weight as text", 'policy = "kv_aware"\ntokenizer = "/t"\nkv_weight = "high"', "kv_weight", "high"),
    ("ttl too long", 'policy = "kv_aware"\ntokenizer = "/t"\nkv_speculative_ttl = "5m"',
     "kv_speculative_ttl", "300s"),
    ("ttl not a duration", 'policy = "kv_aware"\ntokenizer = "/t"\nkv_speculative_ttl = "2"',
     "kv_speculative_ttl", "'2'"),
    ("index empty", 'policy = "kv_aware"\ntokenizer = "/t"\nkv_index_blocks = 0', "kv_index_blocks", "0"),
    ("index huge", 'policy = "kv_aware"\ntokenizer = "/t"\nkv_index_blocks = 100000000',
     "kv_index_blocks", "100000000"),
    ("unknown kv key", 'policy = "kv_aware"\ntokenizer = "/t"\nkv_blocks = 1', "kv_blocks", "1"),
]


@pytest.mark.parametrize(("body", "key", "said"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_kv_keys(tmp_path: Path, keys: Path, body: str, key: str, said: str) -> None:
    path = write(tmp_path, keys, f"[models.m]\n{body}\n")
    with pytest.raises(ConfigError) as info:
        load_router_config(path)
    text = str(info.value)
    assert path in text and f"models.m.{key}" in text and said in text, text
    assert info.value.exit_code == 2
