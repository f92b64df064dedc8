"""The check right before a spawn (indices, health, releasing, free memory and who holds
it) and the inventory's view of this agent's own engine processes."""

from __future__ import annotations

from attrs import evolve

from fakes.supervision import GIB, FakeGpus, gpu
from llmgw.agent.gpus.claims import check_gpus, gpu_memory_min, mark_inventory
from llmgw.model.engine import EngineKind, EngineSpec
from llmgw.model.inventory import Gpu, GpuProcess, Inventory


def spec(*gpus: str, engine: EngineKind = EngineKind.VLLM, args: tuple[str, ...] = (),
         origin: dict[str, object] | None = None) -> EngineSpec:
    return EngineSpec("r1", 1, "dep", "org/m", "m", engine, gpus, 20000, args=args,
                      origin=origin or {})


def test_indices_in_nvml_order_not_spec_order() -> None:
    gpus = FakeGpus(gpu("GPU-a", 3), gpu("GPU-b", 0))
    assert check_gpus(spec("GPU-a", "GPU-b"), gpus() or {}, {}) == {"GPU-a": 3, "GPU-b": 0}
    assert check_gpus(spec(), {}, {}) == {}


def test_missing_gpu() -> None:
    assert check_gpus(spec("GPU-a", "GPU-x"), {"GPU-a": gpu("GPU-a", 0)}, {}) == (
        "GPU GPU-x is not on this node now")


def test_unhealthy_gpu_names_the_problem() -> None:
    bad = gpu("GPU-a", 2, problems=("row remap pending", "MIG mode is on"))
    assert check_gpus(spec("GPU-a"), {"GPU-a": bad}, {}) == (
        "GPU 2 (GPU-a) is unhealthy: row remap pending; MIG mode is on")


def test_releasing_gpu() -> None:
    assert check_gpus(spec("GPU-a"), {"GPU-a": gpu("GPU-a", 3)},
                      {"GPU-a": "releasing after r0 stopped: pid 7 holds 30 GiB"}) == (
        "GPU 3 is releasing: releasing after r0 stopped: pid 7 holds 30 GiB")


def test_held_by_a_foreign_process() -> None:
    gpus = FakeGpus(gpu("GPU-a", 0), gpu("GPU-b", 3))
    gpus.hold("GPU-b", 4242, 61 * GIB, "python train.py")
    gpus.hold("GPU-b", 77, 2 * GIB, "python notebook.py")
    assert check_gpus(spec("GPU-a", "GPU-b"), gpus() or {}, {}) == (
        "GPU 3 held by pid 4242 (python train.py), 61 GiB")


def test_short_of_memory_with_no_process_listed() -> None:
    g = evolve(gpu("GPU-a", 3), free=20 * GIB)
    assert check_gpus(spec("GPU-a"), {"GPU-a": g}, {}) == (
        "GPU 3 has 20 GiB free, the engine needs 73 GiB")  # 0.9 x 80 GiB + its CUDA context


def test_the_engines_own_fraction_and_the_deployments_floor() -> None:
    g = evolve(gpu("GPU-a", 3), free=41 * GIB)  # 0.5 x 80 GiB and the 1 GiB CUDA context
    assert check_gpus(spec("GPU-a", args=("--gpu-memory-utilization", "0.5")),
                      {"GPU-a": g}, {}) == {"GPU-a": 3}
    assert check_gpus(spec("GPU-a", args=("--gpu-memory-utilization", "0.5")),
                      {"GPU-a": evolve(g, free=40 * GIB)}, {}) == (
        "GPU 3 has 40 GiB free, the engine needs 41 GiB")
    floor = {"gpu_memory_min": 50 * GIB}
    assert check_gpus(spec("GPU-a", args=("--gpu-memory-utilization", "0.5"), origin=floor),
                      {"GPU-a": g}, {}) == "GPU 3 has 41 GiB free, the engine needs 50 GiB"
    # the simulated engine takes no memory
    assert check_gpus(spec("GPU-a", engine=EngineKind.SIMULATED), {"GPU-a": evolve(g, free=0)},
                      {}) == {"GPU-a": 3}


def test_own_earlier_session_is_not_the_holder() -> None:
    gpus = FakeGpus(gpu("GPU-a", 3))
    gpus.hold("GPU-a", 10, 70 * GIB, "vllm serve (previous generation)")
    gpus.hold("GPU-a", 11, 5 * GIB, "python train.py")
    assert check_gpus(spec("GPU-a"), gpus() or {}, {}, own_pids=frozenset({10})) == (
        "GPU 3 held by pid 11 (python train.py), 5 GiB")


def test_gpu_memory_min_from_origin() -> None:
    assert gpu_memory_min(spec(origin={"gpu_memory_min": 1000})) == 1000
    for odd in ("1000", True, -5, 1.5, None):
        assert gpu_memory_min(spec(origin={"gpu_memory_min": odd})) == 0
    assert gpu_memory_min(spec()) == 0


def _gpu(uuid: str, *procs: GpuProcess) -> Gpu:
    return Gpu(0, uuid, "H100", 80 * GIB, 10 * GIB, "00000000:18:00.0", processes=procs)


def test_mark_inventory() -> None:
    train = GpuProcess(4242, "python train.py", 30 * GIB)
    ours = GpuProcess(100, "vllm serve", 40 * GIB)
    inv = Inventory(gpus=(_gpu("GPU-a", train, ours), _gpu("GPU-b"),
                          evolve(_gpu("GPU-c"), releasing="stale")))
    out = mark_inventory(inv, frozenset({100, 101}), {"GPU-b": "releasing after r1 stopped",
                                                      "GPU-zz": "not here"})
    a, b, c = out.gpus
    assert a.processes == (train,) and a.releasing == ""
    assert b.releasing == "releasing after r1 stopped" and not b.placeable
    assert c.releasing == ""  # the supervisor is the one that knows
    clean = Inventory(gpus=(_gpu("GPU-a", train),))
    assert mark_inventory(clean, frozenset(), {}) is clean
