"""API keys, limits and usage at the router: the key file and the server's key table,
leases of rpm/tpm/budget and concurrency slots from the leader, the usage tap and its report,
and their metrics. This face imports nothing."""
