"""Copies an engine could not read: marked from the engine's own words, shown incomplete
in every inventory, never picked again, until the scan finds them changed or gone; and the
simulated engine reads a folder's files as a loader would."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from llmgw.agent.engines.weights import resolve_weights
from llmgw.agent.lifecycle.bad_copies import BadCopies, unreadable_reason
from llmgw.model.inventory import ModelCopy, StorageReport
from llmgw.simengine.weights import check_weights

COPY = ModelCopy("org/tiny", "/data/models/org/tiny", 1000, True)
# vLLM 0.32 on a truncated copy, as tests/real_engine/test_vllm_bad_copy.py saw it.
WHY = ("(Worker pid=18069) ERROR 12-04 20:38:04 [multiproc_executor.py:953] safetensors._safetensors_"
       "rust.SafetensorError: Error while deserializing header: incomplete metadata, file not fully covered")


def test_the_engines_words_are_found_in_its_log_tail() -> None:
    tail = ("INFO loading weights", f"ERROR {WHY}", "INFO shutting down")
    assert unreadable_reason(tail) == f"ERROR {WHY}"
    assert unreadable_reason(("CUDA out of memory",)) == ""
    assert len(unreadable_reason(("x" * 1000 + " SafetensorError",))) == 200


def test_a_marked_copy_is_incomplete_and_not_chosen_until_the_scan_says_otherwise() -> None:
    marks = BadCopies()
    scan = StorageReport(True, (COPY,))
    assert marks.add(COPY, WHY) and not marks.add(COPY, WHY)
    shown = marks.apply(scan)
    (c,) = shown.models
    assert not c.complete and c.reason == f"the engine could not read it: {WHY}"
    assert resolve_weights("org/tiny", shown, "/data/models").copy is None  # a download now
    # The same copy in the next scan: still marked; marking an inventory twice is no news.
    assert marks.apply(scan) == shown and marks.apply(shown) == shown
    # Copied again (its size changed): the scan says otherwise, the mark ends.
    fixed = StorageReport(True, (ModelCopy("org/tiny", COPY.path, 2000, True),))
    assert marks.apply(fixed) == fixed and marks.marks == {}
    assert resolve_weights("org/tiny", fixed, "/data/models").arg == COPY.path


def test_a_mark_ends_when_the_copy_is_gone_or_the_scan_itself_calls_it_incomplete() -> None:
    for scan in (StorageReport(True, ()),
                 StorageReport(True, (ModelCopy("org/tiny", COPY.path, 1000, False, "shard missing"),))):
        marks = BadCopies()
        marks.add(COPY, WHY)
        assert marks.apply(scan) == scan and marks.marks == {}


def _safetensors(path: Path, data: bytes, declared: int) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [declared // 4],
                               "data_offsets": [0, declared]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_the_simulated_engine_reads_a_folder_as_a_loader_would(tmp_path: Path) -> None:
    assert check_weights("org/tiny") == ""  # an id: nothing to read
    d = tmp_path / "m"
    d.mkdir()
    assert check_weights(str(d)) == ""
    (d / "config.json").write_text("{}")
    _safetensors(d / "model.safetensors", b"\0" * 16, 16)
    assert check_weights(str(d)) == ""
    _safetensors(d / "model.safetensors", b"\0" * 8, 16)  # truncated by a copy that died
    assert check_weights(str(d)).endswith(
        "Error while deserializing header: incomplete metadata, file not fully covered")
    (d / "model.safetensors").write_bytes(b"w" * 16)
    assert check_weights(str(d)).endswith("header too large")
    (d / "model.safetensors").unlink()
    (d / "config.json").write_text("{not json")
    assert "is not a valid JSON file" in check_weights(str(d))
