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


def _me() -> tuple[str, str]:
    import grp
    import os
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name, grp.getgrgid(os.getegid()).gr_name


def test_issue_hands_the_secret_to_a_service_user(tmp_path: Path) -> None:
    import os
    import pwd

    user, group = _me()
    keys.init_keys(str(tmp_path), keys.handover(group=group))
    server_secret = (tmp_path / "server.key_secret").stat()
    assert stat.S_IMODE(server_secret.st_mode) == 0o640 and server_secret.st_gid == os.getegid()
    _, sec = keys.issue_key(str(tmp_path), "router", "edge", to=keys.handover(owner=f"{user}:{group}"))
    assert stat.S_IMODE(sec.stat().st_mode) == 0o600 and sec.stat().st_uid == os.geteuid()
    if os.geteuid() == 0:  # only root can really give a file away
        nobody = pwd.getpwnam("nobody")
        _, sec = keys.issue_key(str(tmp_path), "router", "edge2", to=keys.handover(owner="nobody"))
        st = sec.stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (nobody.pw_uid, nobody.pw_gid, 0o600)


@pytest.mark.parametrize(("owner", "group", "words"), [
    ("no-such-user-llmgw", None, ["no user 'no-such-user-llmgw'", "sysusers"]),
    (None, "no-such-group-llmgw", ["no group 'no-such-group-llmgw'"]),
    ("root:no-such-group-llmgw", None, ["no group"]),
    ("root", "root", ["give one"]),
])
def test_a_user_or_group_that_does_not_exist_is_a_usage_error(
    tmp_path: Path, owner: str | None, group: str | None, words: list[str]
) -> None:
    with pytest.raises(UsageError) as err:
        keys.handover(owner, group)
    assert all(w in str(err.value) for w in words)


def test_cli_refuses_an_unknown_owner_before_writing_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llmgw.cli import main

    assert main(["keys", "init", "--dir", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["keys", "issue", "router", "edge", "--dir", str(tmp_path), "--owner", "no-such-user-llmgw"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("llmgw: --owner no-such-user-llmgw") and "\n" not in err
    assert not (tmp_path / "edge.key_secret").exists() and not (tmp_path / "authorized" / "edge.key").exists()
    user, _ = _me()
    assert main(["keys", "issue", "router", "edge", "--dir", str(tmp_path), "--owner", user]) == 0
    assert "mode 0600, owner " + user in capsys.readouterr().out
