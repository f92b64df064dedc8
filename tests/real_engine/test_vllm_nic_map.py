"""vLLM's own GPU -> NIC reader takes the map llmgw's plan sets (issue 22): each worker of
the multiproc executor ends up with UCX_NET_DEVICES naming its own GPU's nearest HCA.

vLLM's worker reads the GPUs' bus ids from the CUDA platform and the HCAs' from
/sys/class/infiniband; on this CPU machine both are stood in for, and everything else
(the parsing of VLLM_GPU_NIC_PCIE_MAPPING and VLLM_NIC_SELECTION_VARS, the choice per
local rank, how the variable is written) is vLLM's code."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from llmgw.agent.engines import build_plan
from llmgw.config.agent import AgentConfig, EnginesConfig, KeysConfig, VllmConfig
from llmgw.model.affinity import GpuHca
from llmgw.model.engine import EngineKind, EngineSpec, GangSpec

pytestmark = pytest.mark.real_engine

CHECK = r"""
import json, os, sys
doc = json.load(sys.stdin)
os.environ.update(doc["env"])
os.environ.pop("UCX_NET_DEVICES", None)
from vllm.v1.executor import vllm_net_devices as nd
from vllm.platforms import current_platform
buses = doc["buses"]  # physical index -> GPU bus id
nics = doc["nics"]  # HCA bus id -> name
type(current_platform).get_all_gpu_pci_bus_ids = classmethod(lambda cls: dict(enumerate(buses)))
type(current_platform).device_id_to_physical_device_id = classmethod(
    lambda cls, i: [int(x) for x in os.environ["CUDA_VISIBLE_DEVICES"].split(",")][i])
nd.rdma_name_for_nic_pci = lambda t: next(
    n for b, n in nics.items() if nd.normalize_pci(b) == t)
out = []
for rank in range(doc["ranks"]):
    os.environ.pop("UCX_NET_DEVICES", None)
    nd.set_worker_gpu_nic_mapping(rank)
    out.append(os.environ["UCX_NET_DEVICES"])
print(json.dumps(out))
"""

BUSES = ["00000000:18:00.0", "00000000:19:00.0", "00000000:9a:00.0", "00000000:9b:00.0"]
HCAS = {"0000:1a:00.0": "mlx5_0", "0000:9c:00.0": "mlx5_1"}


def test_each_worker_gets_its_gpus_hca(vllm_venv: Path) -> None:
    cfg = AgentConfig(node_id="n1", server="tcp://10.0.0.9:5555", keys=KeysConfig("s", "p"),
                      mgmt_addr="10.0.0.2", engines=EnginesConfig(vllm=VllmConfig(bin="vllm", launch_mode="mp")))
    gang = GangSpec(2, 1, "10.0.0.1", 29600, ("mlx5_0", "mlx5_1"))
    spec = EngineSpec("r1", 1, "d", "/m", "m", EngineKind.VLLM, ("GPU-c", "GPU-a"), 20001,
                      tensor_parallel=2, gang=gang)
    nics = (GpuHca("GPU-c", 3, "mlx5_1", 1, "PIX", BUSES[3], "0000:9c:00.0"),
            GpuHca("GPU-a", 0, "mlx5_0", 1, "PIX", BUSES[0], "0000:1a:00.0"))
    env = build_plan(spec, cfg, "/w", gpu_indices={"GPU-a": 0, "GPU-c": 3}, nics=nics).main.env
    assert env["CUDA_VISIBLE_DEVICES"] == "3,0"
    r = subprocess.run([str(vllm_venv / "bin" / "python"), "-c", CHECK],
                       input=json.dumps({"env": env, "buses": BUSES, "nics": HCAS, "ranks": 2}),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # Local rank 0 is CUDA device 0 = NVML 3 -> mlx5_1; rank 1 = NVML 0 -> mlx5_0.
    assert json.loads(r.stdout.strip().splitlines()[-1]) == ["mlx5_1:1", "mlx5_0:1"]
