from __future__ import annotations

import stat
from pathlib import Path

import pytest
import zmq.auth

from llmgw.errors import KeyFileError, UsageError
from llmgw.transport import keys


def test_init_issue_list_revoke(tmp_path: Path) -> None:
    d = tmp_path / "k"
    keys.init_keys(str(d))
    assert (d / "server.key").exists() and (d / "authorized").is_dir()
    pub, sec = keys.issue_key(str(d), "node", "gpu-a-01")
    keys.issue_key(str(d), "admin", "ops", out=str(tmp_path / "elsewhere"))
    assert (tmp_path / "elsewhere" / "ops.key_secret").exists()
    assert stat.S_IMODE(sec.stat().st_mode) == 0o600
    assert stat.S_IMODE((d / "server.key_secret").stat().st_mode) == 0o600
    listed = {(k.name, k.role) for k in keys.list_keys(str(d))}
    assert listed == {("gpu-a-01", "node"), ("ops", "admin")}
    pair = keys.load_pair(str(sec))
    assert (pair.role, pair.identity) == ("node", "gpu-a-01")
    assert pair.public_key == zmq.auth.load_certificate(pub)[0]
    keys.revoke_key(str(d), "gpu-a-01")
    assert {k.name for k in keys.list_keys(str(d))} == {"ops"}
    assert (d / "revoked" / "gpu-a-01.key").exists()


def test_authorized_key_carries_role_and_identity(tmp_path: Path) -> None:
    keys.init_keys(str(tmp_path))
    pub, _ = keys.issue_key(str(tmp_path), "router", "edge")
    auth = keys.load_authorized(str(tmp_path / "authorized"))
    (info,) = auth.values()
    assert (info.name, info.role) == ("edge", "router")
    assert info.public_key in auth and info.public_key == zmq.auth.load_certificate(pub)[0]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("node", "bad name"), "bad name"),
        (("wizard", "x"), "unknown role"),
        (("node", "server"), "reserved"),
    ],
)
def test_issue_rejects(tmp_path: Path, args: tuple[str, str], match: str) -> None:
    keys.init_keys(str(tmp_path))
    with pytest.raises(UsageError, match=match):
        keys.issue_key(str(tmp_path), *args)


def test_issue_twice_and_revoke_unknown(tmp_path: Path) -> None:
    keys.init_keys(str(tmp_path))
    keys.issue_key(str(tmp_path), "node", "a")
    with pytest.raises(UsageError, match="authorized already"):
        keys.issue_key(str(tmp_path), "admin", "a")
    with pytest.raises(UsageError, match="no authorized key named 'b'"):
        keys.revoke_key(str(tmp_path), "b")
    with pytest.raises(UsageError, match="exists already"):
        keys.init_keys(str(tmp_path))


def test_not_a_keys_folder(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="llmgw keys init"):
        keys.issue_key(str(tmp_path), "node", "a")


def test_public_file_is_not_a_pair(tmp_path: Path) -> None:
    keys.init_keys(str(tmp_path))
    with pytest.raises(KeyFileError, match="holds no secret key"):
        keys.load_pair(str(tmp_path / "server.key"))
    with pytest.raises(KeyFileError, match="cannot read"):
        keys.load_pair(str(tmp_path / "missing.key_secret"))


def test_authorized_file_without_metadata_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    zmq.auth.create_certificates(tmp_path, "plain")
    assert keys.load_authorized(str(tmp_path)) == {}
    assert "names no valid role" in caplog.text
