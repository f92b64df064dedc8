"""LoRA adapters on a running engine: what to load and unload (pure), and the calls that
do it."""
