"""A deployment file's `autoscale` section into model/autoscale.Autoscale, strictly: every
mistake is a DeploymentError naming the file, `autoscale.KEY` and the value."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmgw.config.duration import duration_from_value
from llmgw.errors import DeploymentError
from llmgw.model.autoscale import Autoscale, Target

_KEYS = ("min", "max", "scale_up_after", "scale_down_after", "idle_to_zero", "sleep_when_idle",
         *(str(t) for t in Target))
MAX_REPLICAS = 100_000


def parse_autoscale(raw: Any, source: str) -> Autoscale:
    def err(key: str, message: str) -> DeploymentError:
        return DeploymentError(source, f"autoscale.{key}" if key else "autoscale", message)

    if not isinstance(raw, Mapping):
        raise err("", f"expected a mapping (min, max, a target), got {raw!r}")
    for key in raw:
        if key not in _KEYS:
            raise err(str(key), f"unknown field (known: {', '.join(_KEYS)})")
    targets = [t for t in Target if str(t) in raw]
    if len(targets) != 1:
        names = " or ".join(str(t) for t in Target)
        raise err("", f"expected one target, {names}" + (", not both" if targets else ""))
    target = targets[0]
    value = raw[str(target)]
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise err(str(target), f"expected a number above zero (per replica), got {value!r}")

    def count(key: str, default: int | None) -> int:
        if key not in raw:
            if default is None:
                raise err(key, "missing (required)")
            return default
        v = raw[key]
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_REPLICAS:
            raise err(key, f"expected a whole number from 0 to {MAX_REPLICAS}, got {v!r}")
        return v

    def duration(key: str, default: float, *, zero: bool = False) -> float:
        if key not in raw:
            return default
        try:
            seconds = duration_from_value(raw[key])
        except ValueError as exc:
            raise err(key, str(exc)) from None
        if seconds < 0 or (seconds == 0 and not zero):
            raise err(key, f"expected a duration above zero such as 30s, got {raw[key]!r}")
        return seconds

    lo, hi = count("min", 1), count("max", None)
    idle = duration("idle_to_zero", 0.0, zero=True)
    if hi < 1:
        raise err("max", f"expected at least 1, got {hi}")
    if lo > hi:
        raise err("min", f"{lo} is above max ({hi})")
    if lo == 0 and not idle:
        raise err("min", "0 needs idle_to_zero (how long without a request before the last "
                         "replica stops), e.g. idle_to_zero: 30m")
    if idle and lo:
        raise err("idle_to_zero", f"needs min: 0 (min is {lo}: the count never goes below it)")
    sleep = raw.get("sleep_when_idle", False)
    if not isinstance(sleep, bool):
        raise err("sleep_when_idle", f"expected true or false, got {sleep!r}")
    if sleep and not idle:
        raise err("sleep_when_idle", "needs idle_to_zero (how long without a request before "
                                     "the replica sleeps) and min: 0")
    return Autoscale(
        min=lo,
        max=hi,
        target=target,
        target_value=float(value),
        scale_up_after=duration("scale_up_after", 15.0),
        scale_down_after=duration("scale_down_after", 300.0),
        idle_to_zero=idle,
        sleep_when_idle=sleep,
    )
