"""The simulated engine takes vLLM's LoRA command line and its runtime-updating switch."""

from __future__ import annotations

import pytest

from llmgw.errors import UsageError
from llmgw.simengine.args import parse_args

BASE = ["serve", "org/m", "--port", "20001", "--served-model-name", "m"]


def test_lora_flags_and_the_switch_as_vllm_reads_them() -> None:
    a = parse_args([*BASE, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "32",
                    "--lora-modules", "sql=/a/sql", "chat=/a/chat"],
                   {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert (a.lora, a.max_loras, a.max_lora_rank) == (True, 2, 32)
    assert a.lora_modules == (("sql", "/a/sql"), ("chat", "/a/chat"))
    assert a.runtime_lora and a.unknown == ()
    for value, on in (("1", True), ("true", True), ("TRUE", True), ("0", False), ("yes", False)):
        assert parse_args(BASE, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value}).runtime_lora is on
    off = parse_args(BASE, {})
    assert not off.lora and not off.runtime_lora and off.lora_modules == ()


def test_a_lora_module_without_a_path_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="NAME=PATH"):
        parse_args([*BASE, "--lora-modules", "sql"], {})
