"""Fakes for tests: fake nvidia-smi scripts, sysfs trees, model folders, engines."""
