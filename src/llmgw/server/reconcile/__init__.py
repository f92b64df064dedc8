"""Reconciliation: the rules (rules.py), one pass's working set (passes.py), the state
between passes, rollout, rebuild, drain, adapters and sleep, and the replica table
(replica_states.py)."""
