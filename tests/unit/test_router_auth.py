"""API key file: hashes, names, allowed models, reload on change."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from llmgw.errors import ConfigError
from llmgw.router.tenants.auth import KeyFile, hash_key, parse_keys


def entry(name: str, key: str, models: str | None = None) -> str:
    line = f'[[key]]\nname = "{name}"\nsha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\n'
    return line + (f"models = {models}\n" if models else "")


def test_check(tmp_path: Path) -> None:
    f = tmp_path / "keys.toml"
    f.write_text(entry("a", "sk-a", '["m1"]') + entry("b", "sk-b") + entry("c", "sk-c", '["*"]'))
    kf = KeyFile(str(f))
    a = kf.check(b"Bearer sk-a", 0.0)
    assert a is not None and a.name == "a" and a.allows("m1") and not a.allows("m2")
    b = kf.check(b"bearer sk-b", 0.0)
    assert b is not None and b.allows("anything")
    c = kf.check(b"Bearer sk-c", 0.0)
    assert c is not None and c.allows("x")
    assert kf.check(b"Bearer nope", 0.0) is None
    assert kf.check(b"Basic sk-a", 0.0) is None
    assert kf.check(None, 0.0) is None
    assert kf.check(b"", 0.0) is None


def test_reload_on_change_and_keep_last_good(tmp_path: Path) -> None:
    f = tmp_path / "keys.toml"
    f.write_text(entry("a", "sk-a"))
    kf = KeyFile(str(f), check_every=1.0)
    assert kf.check(b"Bearer sk-a", 0.0) is not None
    f.write_text(entry("b", "sk-b"))
    os.utime(f, ns=(1, 10**18))
    assert kf.check(b"Bearer sk-b", 0.5) is None  # not checked again yet
    assert kf.check(b"Bearer sk-b", 2.0) is not None
    assert kf.check(b"Bearer sk-a", 2.0) is None
    f.write_text("this is not toml [")
    os.utime(f, ns=(1, 2 * 10**18))
    assert kf.check(b"Bearer sk-b", 4.0) is not None  # invalid file: last good set kept
    f.unlink()
    assert kf.check(b"Bearer sk-b", 6.0) is not None


def test_parse_errors_name_the_entry() -> None:
    with pytest.raises(ConfigError, match=r"key\[0\]\.sha256"):
        parse_keys('[[key]]\nname = "a"\nsha256 = "short"\n', "k.toml")
    with pytest.raises(ConfigError, match=r"key\[0\]\.extra"):
        parse_keys(f'[[key]]\nname = "a"\nsha256 = "{hash_key("x")}"\nextra = 1\n', "k.toml")
    with pytest.raises(ConfigError, match="models"):
        parse_keys(f'[[key]]\nname = "a"\nsha256 = "{hash_key("x")}"\nmodels = "m"\n', "k.toml")
    assert parse_keys("", "k.toml") == {}


def test_a_keys_class_in_the_file() -> None:
    keys = parse_keys(entry("a", "sk-a") + 'class = "batch"\n' + entry("b", "sk-b"), "k.toml")
    assert {k.name: k.priority_class for k in keys.values()} == {"a": "batch", "b": ""}
    for bad in ('class = "Batch"\n', "class = 3\n"):
        with pytest.raises(ConfigError, match=r"key\[0\]\.class"):
            parse_keys(entry("a", "sk-a") + bad, "k.toml")
