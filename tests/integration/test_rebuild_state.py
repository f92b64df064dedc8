"""A server that lost its state folder rebuilds from what the nodes run: no engine is
stopped or restarted, status says what it rebuilt, and applying the same file again
changes nothing (issue 10, item 6)."""

from __future__ import annotations

import json
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from fakes.live import Cluster, engine_pids, wait_for

pytestmark = pytest.mark.slow

SPEC = ("name: keep\nmodel: org/m\nengine: simulated\ngpus_per_node: 1\nreplicas: 2\n"
        "selector:\n  pool: a\nargs: [--max-model-len, '512']\n")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, extra_server='restart_grace = "10s"\n')
    try:
        yield c
    finally:
        c.close()


def _ready(c: Cluster) -> dict[str, int]:
    r = c.ctl("get", "replicas", "-o", "json")
    if r.returncode != 0:
        return {}
    return {x["id"]: x["generation"] for x in json.loads(r.stdout) if x["state"] == "ready"}


def test_lost_state_folder_is_rebuilt_from_the_nodes(cluster: Cluster, tmp_path: Path) -> None:
    server = cluster.start_server()
    for n in ("n1", "n2"):
        cluster.start_agent(n, labels={"pool": "a"}, discovery={"simulated_gpus": 1})
    cluster.wait_states({"n1": "ready", "n2": "ready"})
    f = tmp_path / "keep.yaml"
    f.write_text(SPEC)
    assert cluster.ctl("apply", "-f", str(f)).returncode == 0
    wait_for(lambda: len(_ready(cluster)) == 2, 40, "both replicas ready")
    gens = _ready(cluster)
    pids = engine_pids(tmp_path)
    assert len(pids) == 2

    server.stop(signal.SIGKILL)
    cluster.procs.remove(server)
    shutil.rmtree(tmp_path / "state")
    cluster.start_server()

    wait_for(lambda: _ready(cluster) == gens, 30, "the same replicas ready again, same generations")
    assert engine_pids(tmp_path) == pids  # nothing stopped, nothing restarted
    st = cluster.status()
    assert any("rebuilt from the cluster" in n and "keep" in n for n in st["notes"]), st["notes"]
    (d,) = st["deployments"]
    assert (d["name"], d["replicas"], d["ready"]) == ("keep", 2, 2)
    r = cluster.ctl("apply", "-f", str(f), "-o", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["changed"] is False
    assert _ready(cluster) == gens and engine_pids(tmp_path) == pids
