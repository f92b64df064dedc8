"""`ctl gpu clear NODE GPU` (GPU health): the operator says a GPU's Xid problems were
dealt with (the GPU was reset, or the Xid was judged harmless). A member of the Op union
in requests.py; the server turns it into a ClearGpu message to the node's agent.

Shapes are checked here, on decode; whether the node and the GPU exist is the server's to
say.
"""

from __future__ import annotations

from attrs import field, frozen

# A node id or a GPU's UUID ("GPU-" and 36 characters) is far shorter than this.
MAX_NAME = 128


def _short(_: object, a: object, value: str) -> None:
    if not 0 < len(value) <= MAX_NAME or not value.isprintable():
        raise ValueError(f"{getattr(a, 'name', 'value')}: expected 1 to {MAX_NAME} printable "
                         f"characters, got {value[:80]!r}")


@frozen
class GpuClearOp:
    node: str = field(validator=_short)
    gpu: str = field(validator=_short)  # its index on the node ("2") or its UUID
