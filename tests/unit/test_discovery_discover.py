"""discover(): the trio shell over every part, against fakes only."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from attrs import evolve

from fakes import nvidia_smi as fake
from fakes.models import hf_cache_model, plain_model
from fakes.sysfs import add_hca, ib_tree
from llmgw.agent.discovery.discover import discover, inventory_changed
from llmgw.config.agent import (
    AgentConfig,
    DiscoveryConfig,
    FabricConfig,
    KeysConfig,
    ModelDirConfig,
)
from llmgw.errors import DiscoveryError
from llmgw.model.inventory import FabricState, GpuProcess, GpuSource, Inventory, StorageReport


def config(tmp_path: Path, **kw: object) -> AgentConfig:
    disc = DiscoveryConfig(
        nvidia_smi=str(fake.nvlink_board(tmp_path / "bin")),
        ib_root=str(tmp_path / "ib"),
        prefer_nvml=False,
    )
    base = AgentConfig(
        node_id="gpu-a-01",
        server="tcp://127.0.0.1:7443",
        keys=KeysConfig(secret_key="k", server_key="s"),
        mgmt_addr="127.0.0.1",
        discovery=disc,
        fabrics=(FabricConfig("ib-a", ("mlx5_0", "mlx5_1"), 200),),
        source="agent.yaml",
    )
    return evolve(base, **kw)


def nfs_models(tmp_path: Path) -> tuple[Path, Path]:
    """A model folder on a (pretend) NFS mount: two complete models and an empty one."""
    models = tmp_path / "models"
    plain_model(models, "meta-llama/Llama-3.1-8B")
    hf_cache_model(models, "Qwen", "Qwen2.5-7B")
    (models / "empty").mkdir()
    real = os.path.realpath(models)
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"50 22 0:50 / {real} rw - nfs4 10.0.0.5:/export/models rw\n")
    return models, mountinfo


async def test_whole_node(tmp_path: Path) -> None:
    ib_tree(tmp_path / "ib", 3)
    models, mountinfo = nfs_models(tmp_path)
    cfg = config(tmp_path, model_dirs=(ModelDirConfig(str(models)),))
    inv = await discover(cfg, mountinfo_path=str(mountinfo), pci_root=str(tmp_path))
    assert inv.gpu_source is GpuSource.NVIDIA_SMI
    assert len(inv.gpus) == 8 and inv.gpus[0].nvlink_peers[fake.uuid(7)] == 18
    assert [f.state for f in inv.fabrics] == [FabricState.UP]
    assert inv.unlabelled_hcas == ("mlx5_2",)
    assert inv.storage.asked
    assert inv.storage.holds("meta-llama/Llama-3.1-8B")
    assert inv.storage.holds("Qwen/Qwen2.5-7B")
    assert not inv.storage.holds("empty")
    assert {m.store for m in inv.storage.models} == {"10.0.0.5:/export/models"}
    assert len(inv.warnings) == 1 and "empty directory" in inv.warnings[0]


async def test_not_asked_and_no_gpus(tmp_path: Path) -> None:
    cfg = config(
        tmp_path,
        fabrics=(),
        discovery=DiscoveryConfig(nvidia_smi=str(tmp_path / "none"), prefer_nvml=False),
    )
    inv = await discover(cfg)
    assert inv.storage == StorageReport(asked=False)
    assert inv.gpus == () and inv.gpu_source is GpuSource.NONE
    assert len(inv.warnings) == 1


async def test_missing_hca_is_a_startup_error(tmp_path: Path) -> None:
    add_hca(tmp_path / "ib", "mlx5_0")
    with pytest.raises(DiscoveryError, match="ib-a.*mlx5_1"):
        await discover(config(tmp_path))


async def test_warnings_are_logged_once_across_runs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    add_hca(tmp_path / "ib", "mlx5_0", states=("DOWN",))
    add_hca(tmp_path / "ib", "mlx5_1", states=("DOWN",))
    cfg = config(tmp_path)
    logged: set[str] = set()
    with caplog.at_level(logging.WARNING, logger="llmgw.agent.discovery.discover"):
        first = await discover(cfg, logged=logged)
        second = await discover(cfg, logged=logged)
    assert first.fabrics[0].state is FabricState.DOWN
    assert first.warnings == second.warnings
    assert len([r for r in caplog.records if "ib-a is down" in r.getMessage()]) == 1


async def test_inventory_changed(tmp_path: Path) -> None:
    ib_tree(tmp_path / "ib", 2)
    inv = await discover(config(tmp_path))
    assert inventory_changed(None, inv)
    assert not inventory_changed(inv, inv)
    drift = evolve(inv, gpus=(evolve(inv.gpus[0], memory_free=100), *inv.gpus[1:]))
    assert inventory_changed(inv, drift)
    small = evolve(inv, gpus=(evolve(inv.gpus[0], memory_free=80_500), *inv.gpus[1:]))
    assert not inventory_changed(inv, small)
    assert inventory_changed(inv, evolve(inv, gpus=inv.gpus[1:]))
    assert inventory_changed(inv, evolve(inv, storage=StorageReport(asked=True)))
    assert inventory_changed(Inventory(), evolve(Inventory(), warnings=("x",)))


async def test_inventory_changed_per_gpu_health_processes_and_releasing(tmp_path: Path) -> None:
    ib_tree(tmp_path / "ib", 2)
    inv = await discover(config(tmp_path))
    g = inv.gpus[0]

    def with_gpu(**kw: object) -> Inventory:
        return evolve(inv, gpus=(evolve(g, **kw), *inv.gpus[1:]))

    held = with_gpu(processes=(GpuProcess(4242, "python train.py", 1000),))
    assert inventory_changed(inv, held)
    assert inventory_changed(held, with_gpu(processes=(GpuProcess(4243, "python train.py", 1000),)))
    # Was: a process's memory moving (with its free memory under the slack) read as a change.
    assert not inventory_changed(held, with_gpu(processes=(GpuProcess(4242, "python train.py", 1500),)))
    assert not inventory_changed(held, with_gpu(processes=(GpuProcess(4242, "python train.py --x", 1000),)))
    sick = with_gpu(problems=("lost: GPU is lost",))
    assert inventory_changed(inv, sick)
    assert inventory_changed(sick, with_gpu(problems=("lost: GPU is lost", "Xid 79 at x: y")))
    assert not inventory_changed(sick, sick)
    assert inventory_changed(inv, with_gpu(releasing="r-1: pid 77 still holds 30 GiB"))


async def test_each_gpu_gets_its_pcie_path_from_sysfs(tmp_path: Path) -> None:
    from fakes.sysfs import pcie_tree

    # pcie_box's four L40S on buses 01, 41, 81, C1: two host bridges, 01 and 41 behind one
    # switch, 81 and C1 directly on root ports of the other.
    layout = {
        "gpu0": ("pci0000:00", "0000:00:01.0", "0000:02:00.0", "0000:03:00.0", "0000:01:00.0"),
        "gpu1": ("pci0000:00", "0000:00:01.0", "0000:02:00.0", "0000:03:01.0", "0000:41:00.0"),
        "gpu2": ("pci0000:80", "0000:80:01.0", "0000:81:00.0"),
        "gpu3": ("pci0000:80", "0000:80:02.0", "0000:c1:00.0"),
    }
    pcie_tree(tmp_path / "sys", layout, {"pci0000:00": 0, "pci0000:80": 1})
    ib_tree(tmp_path / "ib", 2)
    cfg = config(tmp_path)
    cfg = evolve(cfg, discovery=evolve(cfg.discovery, nvidia_smi=str(fake.pcie_box(tmp_path / "bin"))))
    inv = await discover(cfg, pci_root=str(tmp_path / "sys" / "bus" / "pci" / "devices"))
    assert [g.pci_path for g in inv.gpus] == list(layout.values())
    # A tree that does not know a GPU leaves its path empty, never an error.
    inv = await discover(cfg, pci_root=str(tmp_path / "nowhere"))
    assert [g.pci_path for g in inv.gpus] == [()] * 4
