"""`ctl apikey` command lines into requests (issue 24): the secret made here (only its hash
goes), budgets, dates, imports, and the operator's mistakes in one line with exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.cli import build_parser, main
from llmgw.ctl import apikey
from llmgw.errors import UsageError
from llmgw.model.apikey import Budget, hash_secret, looks_like_secret
from llmgw.transport.apikey_ops import ApiKeyCreateOp, ApiKeyImportOp, ApiKeyUpdateOp

NOW = 1_800_000_000.0  # 2027-01-15


def op(*argv: str):  # type: ignore[no-untyped-def]
    args = build_parser().parse_args(["ctl", "apikey", *argv])
    return args, apikey.op_of(args, NOW)


def test_create_sends_the_hash_and_prints_the_secret_once() -> None:
    args, o = op("create", "team-a", "--models", "m2,m1", "--rpm", "10", "--budget", "5M/30d",
                 "--expires", "2027-02-01")
    assert isinstance(o, ApiKeyCreateOp)
    assert looks_like_secret(args.secret)
    assert o.sha256 == hash_secret(args.secret) and o.prefix == args.secret[:12]
    assert args.secret not in repr(o)
    assert o.models == ("m1", "m2") and o.rpm == 10
    assert o.budget == Budget(5_000_000, 30 * 86400.0)
    assert o.expires == 1_801_440_000.0  # 2027-02-01 00:00 UTC
    text = apikey.render(args, {"name": "team-a", "prefix": o.prefix, "state": "active",
                                "models": ["m1", "m2"], "rpm": 10, "tpm": 0, "concurrency": 0,
                                "budget": {"tokens": 5_000_000, "period": 2592000.0},
                                "expires": o.expires, "created": NOW, "revoked": 0.0})
    assert args.secret in text and "5000000/30d" in text
    # Two keys never share a secret.
    assert op("create", "b")[0].secret != op("create", "b")[0].secret


def test_update_changes_only_what_is_given() -> None:
    _, o = op("update", "a", "--tpm", "100", "--budget", "none", "--expires", "never")
    assert o == ApiKeyUpdateOp("a", tpm=100, clear_budget=True, expires=0.0)
    _, o = op("update", "a", "--models", "*")
    assert o == ApiKeyUpdateOp("a", models=())


@pytest.mark.parametrize("text", ["5M", "x/1h", "10/forever", "0/1h", "10/-1h"])
def test_bad_budgets(text: str) -> None:
    with pytest.raises(UsageError, match="--budget"):
        apikey.parse_budget(text)


def test_budget_periods() -> None:
    assert apikey.parse_budget("20000/1h") == Budget(20000, 3600.0)
    assert apikey.parse_budget("1k/1w") == Budget(1000, 7 * 86400.0)


def test_dates() -> None:
    with pytest.raises(UsageError, match="in the past"):
        apikey.parse_expires("2020-01-01", NOW)
    with pytest.raises(UsageError, match="expected a date"):
        apikey.parse_expires("next tuesday", NOW)
    assert apikey.parse_expires("2027-02-01T12:00:00+02:00", NOW) == 1_801_440_000.0 + 10 * 3600


def test_import_reads_an_api_keys_file(tmp_path: Path) -> None:
    f = tmp_path / "keys.toml"
    f.write_text(f'[[key]]\nname = "b"\nsha256 = "{hash_secret("x").upper()}"\nmodels = ["m"]\n'
                 f'[[key]]\nname = "a"\nsha256 = "{hash_secret("y")}"\n')
    _, o = op("import", str(f))
    assert o == ApiKeyImportOp((ApiKeyCreateOp("a", hash_secret("y")),
                                ApiKeyCreateOp("b", hash_secret("x"), models=("m",))))


def test_mistakes_are_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[[key]]\nname = 1\n")
    for argv in (["create", "a", "--budget", "lots"], ["create", "a", "--expires", "2001-01-01"],
                 ["create", "bad name"], ["import", str(bad)], ["import", str(tmp_path / "no")],
                 ["create", "a", "--rpm", "-1"]):
        code = main(["ctl", "--server", "tcp://127.0.0.1:1", "apikey", *argv])
        err = capsys.readouterr().err.strip()
        assert code == 2, (argv, err)
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_on_server_loss() -> None:
    _, o = op("create", "a", "--on-server-loss", "deny")
    assert o.on_server_loss == "deny"
    _, o = op("update", "a", "--on-server-loss", "default")
    assert o == ApiKeyUpdateOp("a", on_server_loss="")
    _, o = op("update", "a", "--rpm", "3")
    assert o.on_server_loss is None  # not given: unchanged


def test_priority_class(tmp_path: Path) -> None:
    _, o = op("create", "a", "--class", "batch")
    assert o.priority_class == "batch"
    assert op("create", "a")[1].priority_class == ""  # the routers' default_class
    _, o = op("update", "a", "--class", "default")
    assert o == ApiKeyUpdateOp("a", priority_class="")
    assert op("update", "a", "--rpm", "3")[1].priority_class is None  # not given: unchanged
    with pytest.raises(UsageError, match="--class"):
        op("create", "a", "--class", "Urgent!")
    f = tmp_path / "keys.toml"
    f.write_text(f'[[key]]\nname = "a"\nsha256 = "{hash_secret("y")}"\nclass = "batch"\n')
    assert op("import", str(f))[1] == ApiKeyImportOp((ApiKeyCreateOp("a", hash_secret("y"),
                                                                      priority_class="batch"),))
    text = apikey.render(op("describe", "a")[0], {
        "name": "a", "prefix": "p", "state": "active", "models": [], "rpm": 0, "tpm": 0,
        "concurrency": 0, "budget": None, "expires": 0.0, "created": NOW, "revoked": 0.0,
        "priority_class": "batch"})
    assert "class:        batch" in text
