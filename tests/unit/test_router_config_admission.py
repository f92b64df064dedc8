"""router.toml: the admission and ejection keys (issue 20), shipped defaults and checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq.auth

from llmgw.config.load_router import load_router_config
from llmgw.errors import ConfigError

TEXT = (Path(__file__).resolve().parents[2] / "conf" / "router.toml").read_text()


def write(tmp_path: Path, *edits: tuple[str, str]) -> str:
    d = tmp_path / "keys"
    d.mkdir()
    zmq.auth.create_certificates(str(d), "server")
    zmq.auth.create_certificates(str(d), "router-1")
    text = TEXT.replace('"/etc/llmgw/keys', f'"{d}')
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp_path / "router.toml"
    path.write_text(text)
    return str(path)


def test_shipped_values(tmp_path: Path) -> None:
    cfg = load_router_config(write(tmp_path))
    assert (cfg.eject_after, cfg.max_requests_per_replica, cfg.max_connecting_per_replica) == (3, 1024, 64)
    assert (cfg.queue_size, cfg.queue_wait) == (1024, 10.0)


def test_set(tmp_path: Path) -> None:
    cfg = load_router_config(write(tmp_path, ("queue_size = 1024", "queue_size = 0"),
                                   ('queue_wait = "10s"', 'queue_wait = "250ms"')))
    assert (cfg.queue_size, cfg.queue_wait) == (0, 0.25)


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        ("eject_after = 3", "eject_after = 0", "eject_after"),
        ("max_requests_per_replica = 1024", "max_requests_per_replica = 0", "max_requests_per_replica"),
        ("max_connecting_per_replica = 64", "max_connecting_per_replica = -1", "max_connecting_per_replica"),
        ("queue_size = 1024", "queue_size = -1", "queue_size"),
        ('queue_wait = "10s"', 'queue_wait = "10"', "queue_wait"),
    ],
)
def test_refused(tmp_path: Path, old: str, new: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_router_config(write(tmp_path, (old, new)))


CLASSES = '\n[[classes]]\nname = "interactive"\nttl = "10s"\n[[classes]]\nname = "batch"\nttl = "1m"\n'


def test_no_classes_by_default_and_classes_in_order(tmp_path: Path) -> None:
    assert load_router_config(write(tmp_path)).classes == ()
    (tmp_path / "c").mkdir()
    cfg = load_router_config(write(tmp_path / "c", ('cold_start_budget = "120s"\n',
                                                    'cold_start_budget = "120s"\n' + CLASSES),
                                   ('default_class = ""', 'default_class = "batch"')))
    assert [(c.name, c.ttl) for c in cfg.classes] == [("interactive", 10.0), ("batch", 60.0)]
    assert cfg.default_class == "batch"


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        ('name = "batch"', 'name = "Batch"', r"classes\[1\]\.name"),
        ('name = "batch"', 'name = "interactive"', r"classes\[1\]\.name.*listed twice"),
        ('ttl = "1m"', 'ttl = "0s"', r"classes\[1\]\.ttl"),
        ('ttl = "1m"', 'ttl = "1m"\npriority = 3', r"classes.*priority"),
        ('ttl = "10s"\n', "", r"classes.*ttl"),
    ],
)
def test_bad_classes_are_refused(tmp_path: Path, old: str, new: str, key: str) -> None:
    text = CLASSES.replace(old, new, 1)
    with pytest.raises(ConfigError, match=key):
        load_router_config(write(tmp_path, ('cold_start_budget = "120s"\n',
                                            'cold_start_budget = "120s"\n' + text)))


def test_a_default_class_not_listed_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="default_class.*'urgent' is not one of the classes listed"):
        load_router_config(write(tmp_path, ('default_class = ""', 'default_class = "urgent"')))
