"""The last lines of an engine's log, read backwards from the end of the file."""

from __future__ import annotations

import os

_BLOCK = 64 * 1024


def tail_lines(path: str, lines: int, *, max_bytes: int = 8 * 1024 * 1024) -> tuple[str, ...]:
    """The last `lines` lines of `path` (fewer if the file is shorter; () if missing).

    Reads at most `max_bytes` from the end, block by block, so a huge log costs little.
    Undecodable bytes are replaced, never raised.
    """
    if lines <= 0:
        return ()
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except (FileNotFoundError, IsADirectoryError):
        return ()
    with f:
        end = f.seek(0, os.SEEK_END)
        pos = end
        data = b""
        while pos > 0 and data.count(b"\n") <= lines and end - pos < max_bytes:
            step = min(_BLOCK, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
    text = data.decode(errors="replace")
    parts = text.split("\n")
    if parts and parts[-1] == "":
        parts.pop()  # the newline that ends the last line
    if pos > 0 and parts:
        parts = parts[1:]  # the first part may be a partial line
    return tuple(parts[-lines:])
