"""Where a request goes: the balancer (pure), the endpoint table from the server, engine
load scraped from /metrics, admission queues, holding requests for a model scaled to zero,
and the load report for the autoscaler. This face imports nothing."""
