"""`describe replica` shows the weights each member's engine loads (issue 23), where the
server passes them on (a "weights" entry: node -> the agent's EngineReport.weights)."""

from __future__ import annotations

from llmgw.ctl.render import _describe_replica

BASE = {"id": "tiny-0", "deployment": "tiny", "state": "ready", "generation": 1}
LOCAL = "org/tiny: local plain tree /data/models/org/tiny"
SHARED = "org/tiny: shared HF cache /mnt/weka/models--org--tiny/snapshots/ab (store weka-a)"


def test_one_member() -> None:
    text = _describe_replica({**BASE, "weights": {"gpu-1": LOCAL}})
    assert f"Weights:    {LOCAL} (on gpu-1)" in text.splitlines()


def test_a_gang_line_per_node() -> None:
    lines = _describe_replica({**BASE, "weights": {"gpu-2": SHARED, "gpu-1": LOCAL}}).splitlines()
    i = lines.index("Weights:")
    assert lines[i + 1:i + 3] == [f"  gpu-1: {LOCAL}", f"  gpu-2: {SHARED}"]


def test_a_plain_line_and_nothing_told() -> None:
    assert f"Weights:    {LOCAL}" in _describe_replica({**BASE, "weights": LOCAL})
    for absent in ({}, {"weights": {}}, {"weights": {"gpu-1": ""}}, {"weights": None}):
        assert "Weights" not in _describe_replica({**BASE, **absent})
