"""The llmgw agent: one per GPU node."""
