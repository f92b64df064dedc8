"""HCAs from fake sysfs trees; fabric states from the configured labels."""

from __future__ import annotations

from pathlib import Path

import pytest

from fakes.sysfs import add_hca, ib_tree
from llmgw.agent.discovery.infiniband import (
    assess_fabrics,
    parse_rate,
    parse_state,
    read_hcas,
    subnet_prefix,
)
from llmgw.config.agent import FabricConfig
from llmgw.errors import DiscoveryError
from llmgw.model.inventory import FabricState

IB_A = FabricConfig(name="ib-a", hcas=("mlx5_0", "mlx5_1"), rate_gbps=200)


def test_sysfs_fields() -> None:
    assert parse_state("4: ACTIVE\n") == "ACTIVE"
    assert parse_state("5: LinkUp") == "LinkUp"
    assert parse_rate("200 Gb/sec (4X HDR)") == 200.0
    assert parse_rate("2.5 Gb/sec (1X SDR)") == 2.5
    assert parse_rate("") == 0.0
    assert subnet_prefix("fe80:0000:0000:0000:0e42:a1ff:fe03:0001") == "fe80:0000:0000:0000"


def test_active_ports_are_read(tmp_path: Path) -> None:
    ib_tree(tmp_path, 2)
    hcas = read_hcas(str(tmp_path))
    assert [h.name for h in hcas] == ["mlx5_0", "mlx5_1"]
    port = hcas[1].ports[0]
    assert port.number == 1 and port.active
    assert (port.state, port.phys_state) == ("ACTIVE", "LinkUp")
    assert port.rate_gbps == 200.0
    assert port.link_layer == "InfiniBand"
    assert port.subnet_prefix == "fe80:0000:0000:0000"
    assert hcas[1].node_guid == "0c42:a103:0001:1a2b"


def test_roce_port_reports_ethernet_link_layer(tmp_path: Path) -> None:
    add_hca(tmp_path, "mlx5_bond_0", link_layer="Ethernet", rate=100)
    (hca,) = read_hcas(str(tmp_path))
    assert hca.ports[0].link_layer == "Ethernet"
    assert hca.ports[0].rate_gbps == 100.0


def test_no_infiniband_tree_is_no_hcas(tmp_path: Path) -> None:
    assert read_hcas(str(tmp_path / "absent")) == ()


def test_all_ports_active_is_up_and_extra_hcas_are_unlabelled(tmp_path: Path) -> None:
    ib_tree(tmp_path, 3)
    a = assess_fabrics(read_hcas(str(tmp_path)), (IB_A,))
    assert a.fabrics[0].state is FabricState.UP
    assert a.fabrics[0].hcas == ("mlx5_0", "mlx5_1")
    assert a.unlabelled_hcas == ("mlx5_2",)
    assert a.warnings == ()


def test_all_ports_down_is_down(tmp_path: Path) -> None:
    add_hca(tmp_path, "mlx5_0", states=("DOWN",))
    add_hca(tmp_path, "mlx5_1", states=("DOWN",))
    a = assess_fabrics(read_hcas(str(tmp_path)), (IB_A,))
    assert a.fabrics[0].state is FabricState.DOWN
    assert "ib-a is down" in a.warnings[0]


def test_some_ports_down_is_degraded(tmp_path: Path) -> None:
    add_hca(tmp_path, "mlx5_0")
    add_hca(tmp_path, "mlx5_1", states=("INIT",))
    a = assess_fabrics(read_hcas(str(tmp_path)), (IB_A,))
    assert a.fabrics[0].state is FabricState.DEGRADED
    assert "mlx5_1/1" in a.warnings[0]


def test_rate_mismatch_is_a_warning(tmp_path: Path) -> None:
    ib_tree(tmp_path, 2, rate=400)
    a = assess_fabrics(read_hcas(str(tmp_path)), (IB_A,))
    assert a.fabrics[0].state is FabricState.UP
    assert len(a.warnings) == 2
    assert "400 Gb/s" in a.warnings[0] and "rate_gbps is 200" in a.warnings[0]


def test_hca_named_in_config_but_absent_is_an_error(tmp_path: Path) -> None:
    add_hca(tmp_path, "mlx5_0")
    with pytest.raises(DiscoveryError, match="ib-a.*mlx5_1") as info:
        assess_fabrics(read_hcas(str(tmp_path)), (IB_A,), source="/etc/llmgw/agent.yaml")
    assert info.value.exit_code == 2
    assert "/etc/llmgw/agent.yaml" in str(info.value)


def test_no_fabrics_configured_leaves_every_hca_unlabelled(tmp_path: Path) -> None:
    ib_tree(tmp_path, 2)
    a = assess_fabrics(read_hcas(str(tmp_path)), ())
    assert a.fabrics == ()
    assert a.unlabelled_hcas == ("mlx5_0", "mlx5_1")
