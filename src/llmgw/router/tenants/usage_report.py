"""Sending the router's usage to the server every `usage_report_interval` (API keys and limits): the
trio shell around UsageMeter (router/tenants/usage.py). A batch that failed is sent again, with
its id, until the server has it; on shutdown the last one gets a short, shielded try."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable

import trio

from llmgw.router.tenants.usage import UsageMeter
from llmgw.transport.apikey_ops import UsageReportOp

log = logging.getLogger("llmgw.router.tenants.usage")

UsageSink = Callable[[UsageReportOp], Awaitable[object]]
LAST_TRY = 2.0  # seconds a stopping router gives its last batch


async def send_once(meter: UsageMeter, sink: UsageSink) -> None:
    """Send what is due; a batch the sink raised on stays, to be sent again."""
    due = meter.batch(uuid.uuid4().hex)
    if due is None:
        return
    batch_id, rows = due
    await sink(UsageReportOp(batch_id, rows))
    meter.acked(batch_id)


async def report_usage(meter: UsageMeter, sink: UsageSink, interval: float) -> None:
    failing = False
    try:
        while True:
            await trio.sleep(interval)
            try:
                await send_once(meter, sink)
            except Exception as exc:  # the network: kept, sent again with the same id
                if not failing:
                    log.warning("usage report failed (%s); %d requests kept to send again",
                                exc, meter.unsent)
                failing = True
            else:
                if failing:
                    log.info("usage reports go through again")
                failing = False
    finally:
        if meter.unsent:
            with trio.CancelScope(shield=True, deadline=trio.current_time() + LAST_TRY):
                try:
                    await send_once(meter, sink)
                    await send_once(meter, sink)  # what came in while the first went
                except Exception as exc:  # stopping anyway: say what is lost
                    log.warning("stopping with %d requests' usage not sent: %s", meter.unsent, exc)
