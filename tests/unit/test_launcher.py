"""The launcher's one adaptation to the Ray it finds: --ray-client-server-port only where
Ray Client can run (Ray 2.60 refuses the flag without grpcio)."""

from __future__ import annotations

import os
from pathlib import Path

from llmgw.agent.insession.launcher import _ray_start_argv

HEAD = ["--head", "--port=26379", "--ray-client-server-port=27006", "--block"]


def _fake_ray(tmp_path: Path, has_grpc: bool) -> str:
    """A `ray` console script whose #! names a fake python that can (or cannot) import grpc."""
    python = tmp_path / "python3"
    python.write_text(f"#!/bin/sh\nexit {0 if has_grpc else 1}\n")
    python.chmod(0o755)
    ray = tmp_path / "ray"
    ray.write_text(f"#!{python}\nraise SystemExit(0)\n")
    ray.chmod(0o755)
    return str(ray)


def test_client_port_kept_where_ray_client_is_installed(tmp_path: Path) -> None:
    ray = _fake_ray(tmp_path, has_grpc=True)
    argv = [ray, "start", *HEAD]
    assert _ray_start_argv(argv, dict(os.environ)) == argv


def test_client_port_dropped_without_grpc(tmp_path: Path) -> None:
    ray = _fake_ray(tmp_path, has_grpc=False)
    got = _ray_start_argv([ray, "start", *HEAD], dict(os.environ))
    assert got == [ray, "start", "--head", "--port=26379", "--block"]


def test_unknown_binary_keeps_the_flag(tmp_path: Path) -> None:
    argv = [str(tmp_path / "not-there"), "start", *HEAD]
    assert _ray_start_argv(argv, dict(os.environ)) == argv
    worker = [str(tmp_path / "not-there"), "start", "--address=10.0.0.1:26379", "--block"]
    assert _ray_start_argv(worker, dict(os.environ)) == worker
