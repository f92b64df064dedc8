"""Model folders built in tmp_path: plain and HF cache layouts, complete or not."""

from __future__ import annotations

import os
from pathlib import Path

from fakes.models import hf_cache_model, plain_model
from llmgw.agent.discovery.mountinfo import parse_mountinfo
from llmgw.agent.discovery.storage import scan_dir, scan_storage
from llmgw.config.agent import ModelDirConfig
from llmgw.model.inventory import ModelCopy, StorageReport


def one(top: Path) -> ModelCopy:
    (copy,) = scan_dir(str(top))
    return copy


def test_complete_plain_layout_with_org(tmp_path: Path) -> None:
    d = plain_model(tmp_path, "meta-llama/Llama-3.1-8B", shards=3, shard_bytes=10)
    c = one(tmp_path)
    assert (c.name, c.path, c.complete, c.reason) == ("meta-llama/Llama-3.1-8B", str(d), True, "")
    assert (
        c.size
        == 30 + (d / "config.json").stat().st_size + (d / "model.safetensors.index.json").stat().st_size
    )


def test_complete_plain_layout_without_org(tmp_path: Path) -> None:
    plain_model(tmp_path, "gpt2", index=False, shards=1)
    c = one(tmp_path)
    assert (c.name, c.complete) == ("gpt2", True)


def test_complete_hf_cache_layout(tmp_path: Path) -> None:
    snap = hf_cache_model(tmp_path, "Qwen", "Qwen2.5-7B")
    c = one(tmp_path)
    assert (c.name, c.path, c.complete) == ("Qwen/Qwen2.5-7B", str(snap), True)
    assert c.size > 200  # followed the symlinks to the blobs


def test_hf_cache_uses_the_snapshot_refs_main_names(tmp_path: Path) -> None:
    hf_cache_model(tmp_path, "org", "m", revision="b" * 40)
    old = hf_cache_model(tmp_path, "org", "m", revision="a" * 40, ref=False, shards=1)
    os.utime(old, (2e9, 2e9))  # newer by mtime, but refs/main says b…
    assert one(tmp_path).path.endswith("b" * 40)


def test_hf_cache_without_refs_takes_the_newest_snapshot(tmp_path: Path) -> None:
    hf_cache_model(tmp_path, "org", "m", revision="b" * 40, ref=False)
    new = hf_cache_model(tmp_path, "org", "m", revision="c" * 40, ref=False, shards=1)
    os.utime(new, (2e9, 2e9))
    assert one(tmp_path).path == str(new)


def test_empty_directory_is_not_weights(tmp_path: Path) -> None:
    (tmp_path / "org" / "half").mkdir(parents=True)
    (tmp_path / "bare").mkdir()
    scan = scan_storage((ModelDirConfig(str(tmp_path)),), [])
    by_name = {c.name: c for c in scan.report.models}
    assert not by_name["bare"].complete and by_name["bare"].reason == "empty directory"
    assert not by_name["org/half"].complete
    assert not scan.report.holds("bare") and not scan.report.holds("org/half")
    assert any("bare" in w and "empty directory" in w for w in scan.warnings)


def test_index_listing_a_missing_shard_is_incomplete(tmp_path: Path) -> None:
    plain_model(tmp_path, "org/m", shards=4, missing_shard=2)
    c = one(tmp_path)
    assert not c.complete
    assert "model-00003-of-00004.safetensors" in c.reason and "missing" in c.reason


def test_zero_byte_shard_is_incomplete(tmp_path: Path) -> None:
    plain_model(tmp_path, "org/m", shards=2, empty_shard=0)
    c = one(tmp_path)
    assert not c.complete and "empty" in c.reason


def test_incomplete_blob_in_hf_cache_is_incomplete(tmp_path: Path) -> None:
    hf_cache_model(tmp_path, "org", "m", incomplete_blob=True)
    c = one(tmp_path)
    assert not c.complete and ".incomplete" in c.reason


def test_hf_cache_without_any_snapshot_is_incomplete(tmp_path: Path) -> None:
    blobs = tmp_path / "models--org--m" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / ("e" * 64 + ".incomplete")).write_bytes(b"x")
    c = one(tmp_path)
    assert (c.name, c.complete) == ("org/m", False)
    assert "partial download" in c.reason


def test_dangling_snapshot_link_is_incomplete(tmp_path: Path) -> None:
    snap = hf_cache_model(tmp_path, "org", "m", shards=1)
    target = (snap / "model-00001-of-00001.safetensors").resolve()
    target.unlink()
    c = one(tmp_path)
    assert not c.complete and "missing" in c.reason


def test_partial_markers_in_plain_layout(tmp_path: Path) -> None:
    d = plain_model(tmp_path, "a/part")
    (d / "model-00001-of-00002.safetensors.part").write_bytes(b"x")
    d = plain_model(tmp_path, "a/locked")
    (d / "model-00003-of-00003.safetensors.lock").write_bytes(b"")
    d = plain_model(tmp_path, "a/localdir")
    dl = d / ".cache" / "huggingface" / "download"
    dl.mkdir(parents=True)
    (dl / "model-00002-of-00002.safetensors.lock").write_bytes(b"")
    (dl / "abc123.incomplete").write_bytes(b"x")
    by_name = {c.name: c for c in scan_dir(str(tmp_path))}
    assert "partial download" in by_name["a/part"].reason
    assert "download in progress" in by_name["a/locked"].reason
    assert "abc123.incomplete" in by_name["a/localdir"].reason
    assert not any(c.complete for c in by_name.values())


def test_no_config_or_no_weights_is_incomplete(tmp_path: Path) -> None:
    d = plain_model(tmp_path, "a/noconfig")
    (d / "config.json").unlink()
    d = plain_model(tmp_path, "a/noweights", shards=1, index=False)
    (d / "model-00001-of-00001.safetensors").unlink()
    (d / "README.md").write_text("hi")
    by_name = {c.name: c for c in scan_dir(str(tmp_path))}
    assert by_name["a/noconfig"].reason == "no config.json"
    assert by_name["a/noweights"].reason.startswith("no weight files")


def test_symlink_loops_end(tmp_path: Path) -> None:
    d = plain_model(tmp_path, "org/m")
    os.symlink(d, d / "again")
    os.symlink(tmp_path, tmp_path / "org" / "up")
    by_name = {c.name: c for c in scan_dir(str(tmp_path))}
    assert by_name["org/m"].complete


def test_not_asked_is_not_found_nothing_but_ranks_the_same(tmp_path: Path) -> None:
    not_asked = scan_storage(None, []).report
    found_nothing = scan_storage((ModelDirConfig(str(tmp_path)),), []).report
    assert not_asked == StorageReport(asked=False)
    assert found_nothing == StorageReport(asked=True)
    assert not_asked.holds("org/m") == found_nothing.holds("org/m") is False


def test_missing_model_dir_is_a_warning(tmp_path: Path) -> None:
    scan = scan_storage((ModelDirConfig(str(tmp_path / "absent")),), [])
    assert scan.report == StorageReport(asked=True)
    assert "cannot read" in scan.warnings[0]


def test_local_storage_is_never_taken_for_shared(tmp_path: Path) -> None:
    plain_model(tmp_path, "org/m")
    real = os.path.realpath(tmp_path)
    mounts = parse_mountinfo(
        f"22 1 259:2 / / rw - ext4 /dev/nvme0n1p2 rw\n40 22 259:5 / {real} rw - xfs /dev/nvme4n1 rw\n"
    )
    # Even an operator-given store name does not make local storage shared.
    scan = scan_storage((ModelDirConfig(str(tmp_path), store="filer-a"),), mounts)
    (c,) = scan.report.models
    assert (c.shared, c.store, c.complete) == (False, "", True)
    assert any("local storage" in w for w in scan.warnings)
    # No mountinfo at all: in doubt, local.
    (c,) = scan_storage((ModelDirConfig(str(tmp_path)),), []).report.models
    assert (c.shared, c.store) == (False, "")


def test_shared_mount_is_identified_by_its_source(tmp_path: Path) -> None:
    plain_model(tmp_path, "org/m")
    real = os.path.realpath(tmp_path)
    mounts = parse_mountinfo(f"50 22 0:50 / {real} rw - nfs4 10.0.0.5:/export/models rw\n")
    (c,) = scan_storage((ModelDirConfig(str(tmp_path)),), mounts).report.models
    assert (c.shared, c.store) == (True, "10.0.0.5:/export/models")
    (c,) = scan_storage((ModelDirConfig(str(tmp_path), store="lfs"),), mounts).report.models
    assert (c.shared, c.store) == (True, "lfs")


def test_overrides_win_over_detection(tmp_path: Path) -> None:
    plain_model(tmp_path, "org/m")
    real = os.path.realpath(tmp_path)
    nfs = parse_mountinfo(f"50 22 0:50 / {real} rw - nfs4 10.0.0.5:/export/models rw\n")
    (c,) = scan_storage((ModelDirConfig(str(tmp_path), shared=False),), nfs).report.models
    assert (c.shared, c.store) == (False, "")
    cfg = ModelDirConfig(str(tmp_path), shared=True, store="srp-image")
    (c,) = scan_storage((cfg,), []).report.models
    assert (c.shared, c.store) == (True, "srp-image")


def test_hf_hub_root_one_level_up_is_read_as_the_cache(tmp_path: Path) -> None:
    snap = hf_cache_model(tmp_path / "hub", "org", "m")
    c = one(tmp_path)
    assert (c.name, c.path, c.complete) == ("org/m", str(snap), True)
