"""Whether a GPU may be placed, from what NVML says about it: readings in, problems out.

Pure: `nvml.py` makes the NVML calls and fills a `HealthReading`; a field is None where
NVML answered Not Supported (consumer boards, older GPUs and drivers), which means "not
applicable" and is never a problem.

Problems are hard or soft (model/inventory.py, SOFT_MARK). Hard: what runs on the GPU
moves. Soft: no new replica goes there; what runs stays. NVIDIA on a pending row remap
(nvmlDeviceGetRemappedRows): "A pending remapping won't affect future work on the GPU
since error-containment and dynamic page blacklisting will take care of that"; the reset
that applies it is the operator's to time. Whether a reset (or more) is due NOW is what
NVML's recovery action says (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION): anything but NONE is
hard.

Two small states live here too, each advanced by a pure `next_*` function the shells call
once per reading: `ReadStreak` (an NVML read error counts only after READ_ERRORS_IN_A_ROW
reads of that field failed in a row) and `ResetWatch` (whether the GPU was reset since an
Xid was recorded on it, so that the Xid's problem can go).
"""

from __future__ import annotations

from collections.abc import Mapping

from attrs import field, frozen

from llmgw.model.inventory import soft

# NVML's nvmlGpuFabricState_t (NVML_GPU_FABRIC_STATE_*), the same numbers as pynvml's.
FABRIC_NOT_SUPPORTED = 0
FABRIC_NOT_STARTED = 1
FABRIC_IN_PROGRESS = 2
FABRIC_COMPLETED = 3
NVML_SUCCESS = 0

# NVML's nvmlDeviceGpuRecoveryAction_t (NVML_GPU_RECOVERY_ACTION_*, pynvml's numbers), read
# as the field value NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (drivers from R550; Not Supported
# before, which is None here).
RECOVERY_NONE = 0
RECOVERY_ACTIONS: dict[int, str] = {
    1: "reset the GPU",  # GPU_RESET: terminate its processes, nvidia-smi -r
    2: "reboot the node",  # NODE_REBOOT: the fault may have left the OS inconsistent
    3: "drain peer-to-peer traffic",  # DRAIN_P2P
    4: "drain peer-to-peer traffic and reset the GPU",  # DRAIN_AND_RESET
    5: "recover the IMEX domain",  # RECOVER_IMEX_DOMAIN
    6: "reset the GPU's PCIe bus",  # BUS_RESET
    7: "reboot the system",  # SYSTEM_REBOOT
}

MIG_ON = "MIG mode is on (llmgw places whole GPUs)"
REMAP_PENDING = "row remap pending (reset the GPU when it is idle)"
REMAP_FAILED = "row remap failed"
RETIRED_PENDING = "retired pages pending (reset the GPU when it is idle)"

# A read of one field that fails this many times in a row is a problem; fewer are logged
# and ignored. NVML answers Unknown Error or Timeout now and then under load (a busy
# driver, a GPU in a power-state change); one such answer used to move every replica on
# the GPU, a gang's whole. Three reads are three discovery intervals (a minute each by
# default) or three checks before a spawn: a GPU really gone says GPU_IS_LOST, which
# counts at once.
READ_ERRORS_IN_A_ROW = 3


@frozen
class FabricReading:
    state: int  # FABRIC_*
    status: int  # NVML return code of the fabric registration; meaningful when COMPLETED
    status_text: str = ""  # NVML's words for `status`, where known


@frozen
class HealthReading:
    """One GPU's health fields as NVML gave them; None: Not Supported there (or not read
    this time: a read error, counted by ReadStreak)."""

    mig_current: int | None = None  # nvmlDeviceGetMigMode()[0]: 1 enabled
    ecc_uncorrected_volatile: int | None = None  # since the last driver load or GPU reset
    # nvmlDeviceGetRemappedRows: (correctable, uncorrectable, pending, failure occurred)
    remapped_rows: tuple[int, int, int, int] | None = None
    retired_pages_pending: int | None = None  # pre-Ampere page retirement waiting for reset
    fabric: FabricReading | None = None  # NVSwitch fabric (Hopper HGX and later)
    recovery_action: int | None = None  # RECOVERY_*: what NVML says must happen now
    lost: bool = False  # NVML said GPU_IS_LOST while reading it


@frozen
class Health:
    """A reading's problems: `hard` move what runs; `soft` (marked) keep new work off."""

    hard: tuple[str, ...] = ()
    soft: tuple[str, ...] = ()

    @property
    def lines(self) -> tuple[str, ...]:
        return (*self.hard, *self.soft)


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


def recovery_problem(action: int | None) -> str | None:
    if action is None or action == RECOVERY_NONE:
        return None
    what = RECOVERY_ACTIONS.get(action, f"recovery action {action}")
    return f"NVML asks to {what} (recovery action {action})"


def classify(r: HealthReading) -> Health:
    """The hard and the soft problems of one reading."""
    hard: list[str] = []
    softs: list[str] = []
    if r.mig_current == 1:
        hard.append(MIG_ON)
    if r.ecc_uncorrected_volatile is not None and r.ecc_uncorrected_volatile > 0:
        # Volatile: counted since the driver loaded. The error was contained (its process
        # was told); whether the GPU needs a reset is the recovery action's to say.
        n = r.ecc_uncorrected_volatile
        softs.append(f"{n} volatile uncorrected ECC error{'s' if n != 1 else ''}")
    if r.remapped_rows is not None:
        _corr, _uncorr, pending, failure = r.remapped_rows
        if failure:
            hard.append(REMAP_FAILED)
        if pending:
            softs.append(REMAP_PENDING)
    if r.retired_pages_pending:
        softs.append(RETIRED_PENDING)
    if r.fabric is not None:
        problem = _fabric_problem(r.fabric)
        if problem is not None:
            hard.append(problem)
    action = recovery_problem(r.recovery_action)
    if action is not None:
        hard.append(action)
    return Health(tuple(hard), tuple(soft(s) for s in softs))


def health_problems(r: HealthReading) -> tuple[str, ...]:
    """Why this GPU may not take new work, one line each (hard first, soft ones marked);
    empty: nothing wrong was read."""
    return classify(r).lines


# ---- read errors: a streak per field ----


@frozen
class ReadStreak:
    """One GPU's NVML read errors in a row, per field ("UUID", "ECC errors", ...)."""

    counts: Mapping[str, int] = field(factory=dict)


def next_streak(
    state: ReadStreak, errors: Mapping[str, str], *, limit: int = READ_ERRORS_IN_A_ROW
) -> tuple[ReadStreak, tuple[str, ...]]:
    """After one reading of the GPU whose read `errors` were {field: NVML's words}: the
    new streak, and a problem line for each field that failed `limit` reads in a row. A
    field that read well (absent from `errors`) starts again from nothing."""
    counts = {f: state.counts.get(f, 0) + 1 for f in errors}
    problems = tuple(f"NVML error reading {f}{f' ({n} reads in a row)' if n > 1 else ''}: {errors[f]}"
                     for f, n in counts.items() if n >= limit)
    return ReadStreak(counts), problems


# ---- was the GPU reset since an Xid? ----


@frozen
class ResetWatch:
    """What was read of one GPU since an Xid was recorded on it.

    NVML has no reset counter. What it does have clears only on a reset: a pending row
    remap is applied then, pending retired pages are retired then, the recovery action
    goes back to NONE after the reset it asked for, a lost GPU is readable again, and the
    volatile ECC counters restart from zero. So: each of these seen set since the Xid,
    and every one of them read clear since, is a reset. An Xid after which none of them
    was ever seen set cannot be told from a reset this way: the operator clears it
    (`llmgw ctl gpu clear`)."""

    seen: frozenset[str] = frozenset()  # flags seen set since the Xid
    ecc_high: int | None = None  # the highest volatile uncorrected ECC count since


def reset_flags(r: HealthReading) -> dict[str, bool | None]:
    """Each reset-clearing flag: True set, False read clear, None not read."""
    rows = r.remapped_rows
    return {
        "lost": r.lost,
        "remap pending": None if r.lost or rows is None else bool(rows[2]),
        "retired pages pending": None if r.lost or r.retired_pages_pending is None
        else bool(r.retired_pages_pending),
        "recovery action": None if r.lost or r.recovery_action is None
        else r.recovery_action != RECOVERY_NONE,
    }


def next_reset_watch(state: ResetWatch, r: HealthReading) -> tuple[ResetWatch, bool]:
    """After one reading: the new watch, and True when it shows the GPU was reset (the
    watch then starts again from nothing)."""
    flags = reset_flags(r)
    seen = state.seen | {f for f, v in flags.items() if v}
    ecc = r.ecc_uncorrected_volatile
    if ecc is not None and state.ecc_high is not None and ecc < state.ecc_high:
        return ResetWatch(), True  # a volatile counter went down: only a reset does that
    high = state.ecc_high if ecc is None else max(ecc, state.ecc_high or 0)
    if seen and all(flags[f] is False for f in seen):
        return ResetWatch(), True
    return ResetWatch(seen, high), False
