"""The pure health table: NVML readings in, problem lines out."""

from __future__ import annotations

import pytest

from llmgw.agent.discovery.gpu_health import (
    FABRIC_COMPLETED,
    FABRIC_IN_PROGRESS,
    FABRIC_NOT_STARTED,
    FABRIC_NOT_SUPPORTED,
    FabricReading,
    HealthReading,
    health_problems,
)


def test_nothing_supported_is_healthy() -> None:
    assert health_problems(HealthReading()) == ()


def test_all_clear_is_healthy() -> None:
    r = HealthReading(mig_current=0, ecc_uncorrected_volatile=0, remapped_rows=(12, 0, 0, 0),
                      retired_pages_pending=0, fabric=FabricReading(FABRIC_COMPLETED, 0))
    assert health_problems(r) == ()


@pytest.mark.parametrize(
    ("reading", "problems"),
    [
        (HealthReading(mig_current=1), ("MIG mode is on (llmgw places whole GPUs)",)),
        (HealthReading(ecc_uncorrected_volatile=1), ("1 volatile uncorrected ECC error",)),
        (HealthReading(ecc_uncorrected_volatile=3), ("3 volatile uncorrected ECC errors",)),
        (HealthReading(remapped_rows=(0, 1, 1, 0)), ("row remap pending (reset the GPU)",)),
        (HealthReading(remapped_rows=(0, 1, 0, 1)), ("row remap failed",)),
        (HealthReading(retired_pages_pending=1), ("retired pages pending (reset the GPU)",)),
        (HealthReading(fabric=FabricReading(FABRIC_NOT_SUPPORTED, 0)), ()),
        (HealthReading(fabric=FabricReading(FABRIC_IN_PROGRESS, 0)), ("NVSwitch fabric not ready (in progress)",)),
        (HealthReading(fabric=FabricReading(FABRIC_COMPLETED, 999, "Unknown Error")),
         ("NVSwitch fabric registration failed: Unknown Error",)),
        (HealthReading(fabric=FabricReading(FABRIC_COMPLETED, 10)),
         ("NVSwitch fabric registration failed: NVML status 10",)),
        (HealthReading(fabric=FabricReading(7, 0)), ("NVSwitch fabric in an unknown state (7)",)),
    ],
)
def test_each_problem(reading: HealthReading, problems: tuple[str, ...]) -> None:
    assert health_problems(reading) == problems


def test_fabric_not_started_points_at_the_fabric_manager() -> None:
    (p,) = health_problems(HealthReading(fabric=FabricReading(FABRIC_NOT_STARTED, 0)))
    assert p.startswith("NVSwitch fabric not ready") and "nvidia-fabricmanager" in p


def test_several_problems_in_a_fixed_order() -> None:
    r = HealthReading(mig_current=1, ecc_uncorrected_volatile=2, remapped_rows=(0, 2, 1, 1))
    assert health_problems(r) == ("MIG mode is on (llmgw places whole GPUs)", "2 volatile uncorrected ECC errors",
                                  "row remap pending (reset the GPU)", "row remap failed")


def test_health_module_is_pure() -> None:
    import ast
    from pathlib import Path

    import llmgw.agent.discovery.gpu_health as mod

    tree = ast.parse(Path(mod.__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert names <= {"__future__", "attrs"}
