"""The llmgw server: inventory, placement, reconciliation and status."""
