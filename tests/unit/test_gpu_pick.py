"""TP groups on PCIe-only nodes: one switch before one host bridge before one NUMA node.

Trees are modelled on real PCIe nodes (tests/fakes/sysfs.py); the tier each pick lands
in is checked against the agent's pcie.link_kind, which reads the same paths.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from fakes.sysfs import EIGHT_GPU_NUMA, eight_gpu_layout
from llmgw.model.inventory import Gpu
from llmgw.model.pcie import RANK, link_kind
from llmgw.server.placement.gpu_pick import pick_gpus


def gpu(name: str, path: tuple[str, ...], numa: int | None, index: int = 0) -> Gpu:
    dev = path[-1] if path else f"0000:{index:02x}:00.0"
    return Gpu(
        index=index, uuid=f"GPU-{name}", name="L40S", memory_total=46068, memory_free=46068,
        pci_bus_id="0000" + dev.upper(), numa_node=numa, pci_path=path,
    )


def eight(*names: str) -> list[Gpu]:
    layout = eight_gpu_layout()
    return [
        gpu(n, layout[n], EIGHT_GPU_NUMA[layout[n][0]], int(n[3:]))
        for n in names or [f"gpu{i}" for i in range(8)]
    ]


def names(picked: tuple[tuple[str, ...], bool] | None) -> list[str]:
    assert picked is not None
    return sorted(u.removeprefix("GPU-") for u in picked[0])


def switch(host: str, rp: str, bus: int, slots: int, free: Sequence[int], numa: int, tag: str) -> list[Gpu]:
    """GPUs in `free` slots of a switch with `slots` downstream ports (DFS bus numbers)."""
    up = f"0000:{bus:02x}:00.0"
    return [
        gpu(f"{tag}{i}", (host, rp, up, f"0000:{bus + 1:02x}:{i:02x}.0", f"0000:{bus + 2 + i:02x}:00.0"), numa,
            index=bus + 2 + i)
        for i in free
    ]


def worst(group: Sequence[Gpu]) -> int:
    kinds = [link_kind(a.pci_path, b.pci_path, a.numa_node, b.numa_node) or "SYS"
             for a, b in itertools.combinations(group, 2)]
    return max((RANK[k] for k in kinds), default=0)


def test_same_switch_pair_even_where_bus_numbers_say_otherwise() -> None:
    """Switch A (6 slots, buses 18-1d) has 18 and 1d free; switch B (behind the next root
    port, buses 20-23) has 20 and 23 free; the other socket has two more. 1d and 20 are
    the nearest bus numbers, across the two switches: bus distance picked them."""
    h = "pci0000:15"
    free = (
        switch(h, "0000:15:01.0", 0x16, 6, (0, 5), 0, "a")
        + switch(h, "0000:15:02.0", 0x1E, 4, (0, 3), 0, "b")
        + switch("pci0000:97", "0000:97:01.0", 0x98, 2, (0,), 1, "c")
        + switch("pci0000:b9", "0000:b9:01.0", 0xBA, 2, (0,), 1, "d")
    )
    assert [g.pci_bus_id[9:11] for g in free[:4]] == ["18", "1D", "20", "23"]
    picked = pick_gpus(free, 2)
    assert names(picked) == ["a0", "a5"] and picked is not None and picked[1] is False
    # Without the paths (an older agent), exactly today's choice: nearest bus numbers.
    from attrs import evolve
    assert names(pick_gpus([evolve(g, pci_path=()) for g in free], 2)) == ["a5", "b0"]


def test_best_fit_leaves_the_larger_switch_whole() -> None:
    free = eight("gpu0", "gpu1", "gpu2", "gpu3", "gpu5")
    assert names(pick_gpus(free, 2)) == ["gpu0", "gpu1"]
    h = "pci0000:15"
    four_and_two = (switch(h, "0000:15:01.0", 0x16, 4, (0, 1, 2, 3), 0, "a")
                    + switch(h, "0000:15:02.0", 0x1C, 2, (0, 1), 0, "b"))
    assert names(pick_gpus(four_and_two, 2)) == ["b0", "b1"]
    assert names(pick_gpus(four_and_two, 4)) == ["a0", "a1", "a2", "a3"]
    # One GPU goes where it breaks no pair: the switch with a single free GPU.
    assert names(pick_gpus(eight("gpu0", "gpu1", "gpu3", "gpu4", "gpu5"), 1)) == ["gpu3"]


def test_one_host_bridge_before_one_numa_node() -> None:
    h = "pci0000:00"
    phb = [gpu("p0", (h, "0000:00:01.0", "0000:01:00.0"), 0, 1),
           gpu("p1", (h, "0000:00:03.0", "0000:40:00.0"), 0, 2)]
    # Another host bridge of the same socket, bus numbers closer to p0.
    node = [gpu("n0", ("pci0000:02", "0000:02:01.0", "0000:03:00.0"), 0, 0)]
    picked = pick_gpus(node + phb, 2)
    assert names(picked) == ["p0", "p1"]
    assert worst([g for g in node + phb if g.uuid in picked[0]]) == RANK["PHB"]  # type: ignore[index]


def test_pxb_under_cascaded_switches() -> None:
    h, rp, up = "pci0000:00", "0000:00:01.0", "0000:01:00.0"
    g1 = gpu("x1", (h, rp, up, "0000:02:00.0", "0000:03:00.0", "0000:04:00.0", "0000:05:00.0"), 0)
    g2 = gpu("x2", (h, rp, up, "0000:02:01.0", "0000:07:00.0", "0000:08:00.0", "0000:09:00.0"), 0)
    other = gpu("y", (h, "0000:00:02.0", "0000:06:00.0"), 0)  # bus 06: between them
    assert names(pick_gpus([g1, other, g2], 2)) == ["x1", "x2"]


def test_numa_node_then_across_sockets() -> None:
    assert names(pick_gpus(eight(), 4)) == ["gpu0", "gpu1", "gpu2", "gpu3"]
    # 6 of 7 across the sockets: the whole of one, then a switch pair of the other
    # (gpu0+gpu1), not the lone gpu2.
    seven = eight("gpu0", "gpu1", "gpu2", "gpu4", "gpu5", "gpu6", "gpu7")
    assert names(pick_gpus(seven, 6)) == ["gpu0", "gpu1", "gpu4", "gpu5", "gpu6", "gpu7"]


def test_gpus_without_a_path_fall_back_to_bus_distance() -> None:
    layout = eight_gpu_layout()
    # Only gpu0 and gpu2 have paths (NODE apart); gpu1 has none: the old order decides.
    free = [gpu("gpu0", layout["gpu0"], 0, 0), gpu("gpu1", (), 0, 0x19),
            gpu("gpu2", layout["gpu2"], 0, 2)]
    assert pick_gpus(free, 2) is not None
    # Two with paths on one switch are still found beside one without.
    free = [gpu("gpu0", layout["gpu0"], 0, 0), gpu("z", (), 0, 0x17), gpu("gpu1", layout["gpu1"], 0, 1)]
    assert names(pick_gpus(free, 2)) == ["gpu0", "gpu1"]


def test_nvlink_clique_still_wins() -> None:
    from attrs import evolve
    free = eight()
    free[0] = evolve(free[0], nvlink_peers={"GPU-gpu7": 4})
    picked = pick_gpus(free, 2)
    assert names(picked) == ["gpu0", "gpu7"] and picked is not None and picked[1] is True


# --- every pick is in the nearest tier any k of the free GPUs could give ----------------

HOSTS = (("pci0000:00", 0), ("pci0000:40", 0), ("pci0000:80", 1), ("pci0000:c0", None))


@st.composite
def trees(draw: st.DrawFn) -> list[Gpu]:
    n = draw(st.integers(2, 7))
    out = []
    for i in range(n):
        host, numa = draw(st.sampled_from(HOSTS))
        branch = draw(st.lists(st.integers(0, 1), min_size=1, max_size=4))
        # Bridge names derive from their prefix, so the paths form one tree.
        bridges = tuple(f"{host}/{''.join(map(str, branch[: j + 1]))}" for j in range(len(branch)))
        out.append(gpu(f"g{i}", (host, *bridges, f"dev{i}"), numa, index=i))
    return out


@settings(max_examples=300, deadline=None)
@given(trees(), st.integers(1, 7))
def test_pick_is_in_the_nearest_tier(free: list[Gpu], k: int) -> None:
    picked = pick_gpus(free, k)
    if k > len(free):
        assert picked is None
        return
    assert picked is not None and len(set(picked[0])) == k
    group = [g for g in free if g.uuid in picked[0]]
    best = min(worst(c) for c in itertools.combinations(free, k))
    assert worst(group) == best
