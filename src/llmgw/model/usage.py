"""Usage per API key × model × hour × HTTP status (API keys and limits), pure. Routers count, send
batches with an id, and the server adds each batch once (a batch retried after a failover
is counted once: the store remembers batch ids)."""

from __future__ import annotations

from collections.abc import Iterable

from attrs import evolve, frozen

HOUR = 3600.0


def hour_of(ts: float) -> int:
    """The epoch second the hour holding `ts` began at."""
    return int(ts // HOUR * HOUR)


@frozen
class UsageRow:
    api_key: str  # the key's name ("" for requests without keys)
    model: str  # as the client named it (a served name or an adapter)
    hour: int  # hour_of(the request's end)
    status: int  # the HTTP status the client got
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_sum: float = 0.0  # seconds, summed: the mean is latency_sum / requests

    @property
    def group(self) -> tuple[str, str, int, int]:
        return (self.api_key, self.model, self.hour, self.status)


def merge(rows: Iterable[UsageRow]) -> list[UsageRow]:
    """Rows of one group added up, in a stable order."""
    out: dict[tuple[str, str, int, int], UsageRow] = {}
    for r in rows:
        have = out.get(r.group)
        out[r.group] = r if have is None else evolve(
            have, requests=have.requests + r.requests,
            prompt_tokens=have.prompt_tokens + r.prompt_tokens,
            completion_tokens=have.completion_tokens + r.completion_tokens,
            latency_sum=have.latency_sum + r.latency_sum)
    return [out[g] for g in sorted(out)]
