"""attrs data shared by every part of llmgw. Imports nothing else of llmgw."""
