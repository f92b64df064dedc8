"""Durations as operators write them: `500ms`, `5s`, `1m`, `2h`, `1m30s`.

Loaded configuration holds durations as float seconds. A string must carry a unit
(a bare "5" could mean seconds or milliseconds, so it is refused); a number written
as a YAML/TOML number is taken as seconds.
"""

from __future__ import annotations

import math
import re
from typing import Annotated

UNITS: dict[str, float] = {
    "ms": 0.001,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}

_PART = re.compile(r"(\d+(?:\.\d+)?|\.\d+)(ms|s|m|h)")


class _DurationMarker:
    """Marks a float attribute as a duration for the config converter."""


# A float in seconds that config files write as "5s". Type checkers see a float.
Duration = Annotated[float, _DurationMarker]


def parse_duration(text: str) -> float:
    """Parse a duration string into seconds. Raises ValueError with an operator's message."""
    s = text.strip()
    if not s:
        raise ValueError("empty duration; write e.g. 500ms, 5s, 1m or 1m30s")
    if s.startswith("-"):
        raise ValueError(f"negative duration {text!r}; durations are never negative")
    if _is_bare_number(s):
        raise ValueError(f"duration {text!r} has no unit; write e.g. {s}s or {s}ms (units: ms, s, m, h)")
    total = 0.0
    pos = 0
    seen: list[str] = []
    for m in _PART.finditer(s):
        if m.start() != pos:
            break
        unit = m.group(2)
        if unit in seen:
            raise ValueError(f"duration {text!r} repeats the unit {unit!r}")
        seen.append(unit)
        total += float(m.group(1)) * UNITS[unit]
        pos = m.end()
    if pos != len(s) or not seen:
        raise ValueError(f"cannot read {text!r} as a duration; write e.g. 500ms, 5s, 1m, 2h or 1m30s")
    if not math.isfinite(total):
        raise ValueError(f"duration {text!r} is too large")
    return total


def duration_from_value(value: object) -> float:
    """A config value (string with unit, or a number meaning seconds) into seconds."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as 5s, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
        if not math.isfinite(seconds):
            raise ValueError(f"duration {value!r} is not a finite number of seconds")
        if seconds < 0:
            raise ValueError(f"negative duration {value!r}; durations are never negative")
        return seconds
    if isinstance(value, str):
        return parse_duration(value)
    raise ValueError(f"expected a duration such as 5s, got {value!r}")


def format_duration(seconds: float) -> str:
    """Seconds back into the shortest exact form that parse_duration reads."""
    if seconds < 1 and seconds * 1000 == int(seconds * 1000):
        return f"{int(seconds * 1000)}ms"
    if seconds == int(seconds):
        whole = int(seconds)
        if whole and whole % 3600 == 0:
            return f"{whole // 3600}h"
        if whole and whole % 60 == 0:
            return f"{whole // 60}m"
        return f"{whole}s"
    return f"{seconds:g}s"


def _is_bare_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True
