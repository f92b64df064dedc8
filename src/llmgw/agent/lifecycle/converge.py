"""The convergence decision: desired engine specs against running engines -> actions.

Pure: data in, data out. No trio, no os, no clock. The supervisor carries out the
actions it returns. Level-triggered: the same inputs always give the same answer, and
applying the answer then asking again gives no actions.
"""

from __future__ import annotations

from collections.abc import Mapping

from attrs import frozen

from llmgw.model.engine import EngineSpec


@frozen
class Start:
    spec: EngineSpec


@frozen
class Stop:
    replica_id: str
    generation: int
    reason: str


Action = Start | Stop


def converge(
    desired: tuple[EngineSpec, ...],
    running: Mapping[str, int],
    exited: Mapping[str, int] | None = None,
) -> tuple[Action, ...]:
    """Actions that turn `running` ({replica_id: generation}) into `desired`.

    `exited` ({replica_id: generation}) names engines that ended on their own. One is not
    started again for the same generation: restarting is the server's decision (with its
    backoff), and it asks by sending a new generation.

    Stops come first (a changed generation is a stop then a start, and a stop frees the
    GPUs and ports the start may need). A replica named twice in `desired` keeps its
    highest generation. Output order is stable: by replica id within each kind.
    """
    wanted: dict[str, EngineSpec] = {}
    for spec in desired:
        have = wanted.get(spec.replica_id)
        if have is None or spec.generation > have.generation:
            wanted[spec.replica_id] = spec
    stops: list[Action] = []
    starts: list[Action] = []
    for replica_id in sorted(running):
        generation = running[replica_id]
        want = wanted.get(replica_id)
        if want is None:
            stops.append(Stop(replica_id, generation, "no longer in the desired set"))
        elif want.generation != generation:
            stops.append(
                Stop(replica_id, generation, f"replaced by generation {want.generation}")
            )
    for replica_id in sorted(wanted):
        spec = wanted[replica_id]
        if running.get(replica_id) != spec.generation and (exited or {}).get(
            replica_id
        ) != spec.generation:
            starts.append(Start(spec))
    return tuple(stops + starts)
