"""A deployment's `autoscale` section (elastic deployments): replicas that follow load between `min`
and `max`. Pure data; the decision is server/elastic/decide.py's.

    autoscale:
      min: 1
      max: 8
      in_flight_per_replica: 16    # or waiting_per_replica: 4 (one target, not both)
      scale_up_after: 15s          # the need must last this long before a step up
      scale_down_after: 5m         # ... and the lower need this long before a step down
      idle_to_zero: 30m            # off unless set: no request for this long -> 0 replicas
      sleep_when_idle: true        # vLLM only: the engine starts with sleep mode enabled

With `autoscale` set, the deployment's `replicas` is the current count, which the server
moves. `min: 0` and `idle_to_zero` go together: while requests come the count stays at
one or more; after `idle_to_zero` without any, it goes to zero, and the next request
wakes it.

`sleep_when_idle` (vLLM only, with `idle_to_zero`) starts the engines with vLLM's sleep
mode (`--enable-sleep-mode`, the /sleep, /wake_up and /is_sleeping endpoints served with
VLLM_SERVER_DEV_MODE=1), so that an idle replica may free its GPU memory and keep its
process. Unlike the rest of this section it shapes the engine (vLLM takes sleep mode only
at start), so it is part of the deployment's template_hash: turning it on or off rolls.
"""

from __future__ import annotations

import enum
from typing import Any

from attrs import frozen


class Target(enum.StrEnum):
    """What the count follows: requests in flight (sent to an engine, not answered) or
    requests the engines hold waiting (their own queue), per replica, summed over routers."""

    IN_FLIGHT = "in_flight_per_replica"
    WAITING = "waiting_per_replica"


@frozen
class Autoscale:
    min: int
    max: int
    target: Target
    target_value: float  # > 0: that many per replica
    scale_up_after: float = 15.0  # seconds
    scale_down_after: float = 300.0  # seconds
    idle_to_zero: float = 0.0  # seconds without a request before going to zero; 0: never
    sleep_when_idle: bool = False  # engines start with vLLM's sleep mode (shapes the engine)

    def plain(self) -> dict[str, Any]:
        """As a deployment file holds it (the inverse of config/deployment.py's parsing)."""
        out: dict[str, Any] = {
            "min": self.min,
            "max": self.max,
            str(self.target): self.target_value,
            "scale_up_after": self.scale_up_after,
            "scale_down_after": self.scale_down_after,
        }
        if self.idle_to_zero:
            out["idle_to_zero"] = self.idle_to_zero
        if self.sleep_when_idle:
            out["sleep_when_idle"] = True
        return out
