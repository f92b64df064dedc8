"""Tenants: API keys, leases of a key's allowance, limits, usage metrics."""
