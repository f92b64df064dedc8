"""Whether a GPU may be placed, from what NVML says about it: readings in, problems out.

Pure: `nvml.py` makes the NVML calls and fills a `HealthReading`; a field is None where
NVML answered Not Supported (consumer boards, older GPUs and drivers), which means "not
applicable" and is never a problem.
"""

from __future__ import annotations

from attrs import frozen

# NVML's nvmlGpuFabricState_t (NVML_GPU_FABRIC_STATE_*), the same numbers as pynvml's.
FABRIC_NOT_SUPPORTED = 0
FABRIC_NOT_STARTED = 1
FABRIC_IN_PROGRESS = 2
FABRIC_COMPLETED = 3
NVML_SUCCESS = 0

MIG_ON = "MIG mode is on (llmgw places whole GPUs)"
REMAP_PENDING = "row remap pending (reset the GPU)"
REMAP_FAILED = "row remap failed"
RETIRED_PENDING = "retired pages pending (reset the GPU)"


@frozen
class FabricReading:
    state: int  # FABRIC_*
    status: int  # NVML return code of the fabric registration; meaningful when COMPLETED
    status_text: str = ""  # NVML's words for `status`, where known


@frozen
class HealthReading:
    """One GPU's health fields as NVML gave them; None: Not Supported there."""

    mig_current: int | None = None  # nvmlDeviceGetMigMode()[0]: 1 enabled
    ecc_uncorrected_volatile: int | None = None  # since the last driver load
    # nvmlDeviceGetRemappedRows: (correctable, uncorrectable, pending, failure occurred)
    remapped_rows: tuple[int, int, int, int] | None = None
    retired_pages_pending: int | None = None  # pre-Ampere page retirement waiting for reset
    fabric: FabricReading | None = None  # NVSwitch fabric (Hopper HGX and later)


def _fabric_problem(f: FabricReading) -> str | None:
    if f.state == FABRIC_NOT_SUPPORTED:
        return None
    if f.state == FABRIC_NOT_STARTED:
        # CUDA init fails on such a GPU until the fabric manager has registered it.
        return "NVSwitch fabric not ready (not started: is nvidia-fabricmanager running?)"
    if f.state == FABRIC_IN_PROGRESS:
        return "NVSwitch fabric not ready (in progress)"
    if f.state == FABRIC_COMPLETED:
        if f.status == NVML_SUCCESS:
            return None
        why = f.status_text or f"NVML status {f.status}"
        return f"NVSwitch fabric registration failed: {why}"
    return f"NVSwitch fabric in an unknown state ({f.state})"


def health_problems(r: HealthReading) -> tuple[str, ...]:
    """Why this GPU may not be placed, one line each; empty: nothing wrong was read."""
    out: list[str] = []
    if r.mig_current == 1:
        out.append(MIG_ON)
    if r.ecc_uncorrected_volatile is not None and r.ecc_uncorrected_volatile > 0:
        n = r.ecc_uncorrected_volatile
        out.append(f"{n} volatile uncorrected ECC error{'s' if n != 1 else ''}")
    if r.remapped_rows is not None:
        _corr, _uncorr, pending, failure = r.remapped_rows
        if pending:
            out.append(REMAP_PENDING)
        if failure:
            out.append(REMAP_FAILED)
    if r.retired_pages_pending:
        out.append(RETIRED_PENDING)
    if r.fabric is not None:
        problem = _fabric_problem(r.fabric)
        if problem is not None:
            out.append(problem)
    return tuple(out)
