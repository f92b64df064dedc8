"""`llmgw config example NAME`: the annotated files of conf/ and systemd/, and the
no-InfiniBand agent example that loads and runs discovery on a node without HCAs.

(The files as a built wheel ships them: tests/integration/test_packaging.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from attrs import evolve

from fakes import nvidia_smi as fake
from fakes.sysfs import ib_tree
from llmgw import examples
from llmgw.agent.discovery.discover import discover
from llmgw.cli import main
from llmgw.config.agent import AgentConfig
from llmgw.config.load_agent import load_agent_config
from llmgw.dev import DEMO
from llmgw.errors import EXIT_USAGE, DiscoveryError, UsageError
from llmgw.transport import keys

REPO = Path(__file__).resolve().parents[2]


def runnable(text: str, tmp_path: Path) -> Path:
    """An agent example with what must be substituted substituted: its key files (issued
    here, as `llmgw keys issue node gpu-a-01` would on the server)."""
    kd = tmp_path / "keys"
    keys.init_keys(str(kd))
    keys.issue_key(str(kd), "node", "gpu-a-01")
    assert "/etc/llmgw/keys/" in text
    path = tmp_path / "agent.yaml"
    path.write_text(text.replace("/etc/llmgw/keys/", f"{kd}/"))
    return path


def test_every_example_is_a_file_of_the_repository() -> None:
    for ex in examples.EXAMPLES:
        assert examples.locate(ex.relpath) == REPO / ex.relpath
    assert examples.locate("README.md") == REPO / "README.md"


def test_bare_lists_the_names_and_a_name_prints_the_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "example"]) == 0
    listed = capsys.readouterr().out
    assert [line.split()[0] for line in listed.splitlines()[1:]] == [e.name for e in examples.EXAMPLES]
    assert main(["config", "example", "server"]) == 0
    assert capsys.readouterr().out == (REPO / "conf/server.toml").read_text()
    assert main(["config", "example", "sysusers"]) == 0
    assert capsys.readouterr().out == (REPO / "systemd/llmgw.sysusers.conf").read_text()


def test_bare_config_prints_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config"]) == 0
    assert "example" in capsys.readouterr().out


def test_an_unknown_name_is_a_usage_error_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UsageError):
        examples.example_text("agnet")
    assert main(["config", "example", "agnet"]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert "\n" not in err and err.startswith("llmgw: ") and "'agnet'" in err and "agent-no-ib" in err


def test_without_infiniband_changes_fabrics_only() -> None:
    text = (REPO / "conf/agent.yaml").read_text()
    full, no_ib = yaml.safe_load(text), yaml.safe_load(examples.without_infiniband(text))
    assert full["fabrics"] and no_ib["fabrics"] == []
    assert {k: v for k, v in full.items() if k != "fabrics"} == {
        k: v for k, v in no_ib.items() if k != "fabrics"}
    assert examples.example_text("agent-no-ib") == examples.without_infiniband(text)


def test_the_printed_agent_examples_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "example", "agent"]) == 0
    full = load_agent_config(str(runnable(capsys.readouterr().out, tmp_path / "a")))
    assert [f.name for f in full.fabrics] == ["ib-a"]
    assert main(["config", "example", "agent-no-ib"]) == 0
    no_ib = load_agent_config(str(runnable(capsys.readouterr().out, tmp_path / "b")))
    assert no_ib.fabrics == ()
    assert evolve(no_ib, fabrics=full.fabrics, source=full.source, keys=full.keys) == full


def _on_fake_node(cfg_path: Path, tmp_path: Path, ib_root: Path) -> AgentConfig:
    cfg = load_agent_config(str(cfg_path))
    disc = evolve(cfg.discovery, nvidia_smi=str(fake.nvlink_board(tmp_path / "bin")),
                  prefer_nvml=False, ib_root=str(ib_root))
    return evolve(cfg, discovery=disc)


async def test_no_ib_example_runs_discovery_on_a_node_without_infiniband(tmp_path: Path) -> None:
    no_sysfs = tmp_path / "sys" / "class" / "infiniband"  # never created: no IB stack at all
    cfg = _on_fake_node(runnable(examples.example_text("agent-no-ib"), tmp_path), tmp_path, no_sysfs)
    inv = await discover(cfg, pci_root=str(tmp_path))
    assert len(inv.gpus) == 8
    assert inv.hcas == () and inv.fabrics == () and inv.unlabelled_hcas == ()

    # The full example on the same node is what an operator hit before: a missing HCA.
    full = _on_fake_node(runnable(examples.example_text("agent"), tmp_path / "full"), tmp_path, no_sysfs)
    with pytest.raises(DiscoveryError, match="mlx5_0"):
        await discover(full, pci_root=str(tmp_path))


async def test_no_ib_example_on_a_node_with_hcas_labels_none(tmp_path: Path) -> None:
    """HCAs the operator has not labelled are reported as such, never given a fabric."""
    cfg = _on_fake_node(runnable(examples.example_text("agent-no-ib"), tmp_path), tmp_path,
                        ib_tree(tmp_path / "ib", 2))
    inv = await discover(cfg, pci_root=str(tmp_path))
    assert inv.fabrics == () and inv.unlabelled_hcas == ("mlx5_0", "mlx5_1")


def test_dev_demo_is_the_shipped_demo_deployment() -> None:
    assert yaml.safe_load(examples.example_text("deployment-demo")) == DEMO
