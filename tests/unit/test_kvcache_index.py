"""The router's block keys and the per-replica block index: chaining, orphans, the bound,
speculative entries; properties over random event streams."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.kvcache import blocks
from llmgw.kvcache.events import Cleared, Event, Removed, Stored
from llmgw.kvcache.index import KvIndex

BS = 4


def _tokens(n_blocks: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n_blocks * BS)]


def _keys(ix: KvIndex, tokens: list[int], lora: str | None = None) -> list[int]:
    return blocks.chain_keys(tokens, BS, ix.seed(lora))


# -- keys ------------------------------------------------------------------------------

def test_keys_chain_and_depend_on_every_earlier_block_and_the_seed() -> None:
    s = blocks.seed("m", None)
    a = blocks.chain_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, s)
    assert len(a) == 2  # the partial third block has no key
    assert blocks.chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, s) == a
    assert blocks.chain_keys([0, 2, 3, 4, 5, 6, 7, 8], 4, s)[1] != a[1]
    assert blocks.chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, blocks.seed("m", "lora"))[0] != a[0]
    assert blocks.chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, blocks.seed("n", None))[0] != a[0]
    # Chaining from a parent key continues the same chain.
    assert blocks.chain_keys([5, 6, 7, 8], 4, s, parent=a[0]) == a[1:]
    # The same on every run and host (no PYTHONHASHSEED, no native byte order): a golden value.
    assert (s, blocks.chain(0, s, [1, 2, 3, 4])) == (3712543182595421055, 6177210531626596595)


# -- index -----------------------------------------------------------------------------

def test_a_request_matches_the_run_an_engine_stored_across_events() -> None:
    ix = KvIndex("m", max_blocks=100)
    toks = _tokens(3)
    ix.apply_events("r1", [Stored(block_hashes=(b"a", b"b"), parent=None, token_ids=tuple(toks[:8]), block_size=BS)])
    ix.apply_events("r1", [Stored(block_hashes=(b"c",), parent=b"b", token_ids=tuple(toks[8:]), block_size=BS)])
    assert ix.block_size() == BS
    keys = _keys(ix, toks + [99] * 4)
    assert ix.match(keys, now=0.0) == {"r1": 3}
    assert ix.match(_keys(ix, [7] + toks[1:]), now=0.0) == {}  # first block differs
    assert ix.match(_keys(ix, toks, lora="x"), now=0.0) == {}  # another adapter's chain


def test_an_unknown_parent_is_an_orphan_not_a_guess() -> None:
    ix = KvIndex("m", max_blocks=100)
    out = ix.apply_events("r1", [Stored(block_hashes=(b"c", b"d"), parent=b"lost",
                                        token_ids=tuple(_tokens(2)), block_size=BS)])
    assert (out.orphans, out.stored, ix.size("r1")) == (2, 0, 0)
    # ...and so are its children.
    out = ix.apply_events("r1", [Stored(block_hashes=(b"e",), parent=b"d", token_ids=tuple(_tokens(1)), block_size=BS)])
    assert out.orphans == 1


def test_blocks_whose_hash_took_in_more_than_tokens_are_not_placed() -> None:
    ix = KvIndex("m", max_blocks=100)
    toks = tuple(_tokens(2))
    # A multimodal id in the second block: the first is placed, the second and on are not.
    out = ix.apply_events("r1", [Stored(block_hashes=(1, 2), parent=None, token_ids=toks,
                                        block_size=BS, extra_keys=(None, (("img", 0),)))])
    assert (out.stored, out.orphans) == (1, 1)
    # The adapter's own name in extra keys is what the seed already says: placed.
    out = ix.apply_events("r2", [Stored(block_hashes=(1, 2), parent=None, token_ids=toks, block_size=BS,
                                        lora_name="ad", extra_keys=(("ad",), ("ad",)))])
    assert out.stored == 2
    assert ix.match(_keys(ix, list(toks), "ad"), 0.0) == {"r2": 2}
    # A salted store (SGLang) and tokens that do not line up with the hashes (vLLM's
    # null sliding-window blocks) are not placed either.
    assert ix.apply_events("r3", [Stored(block_hashes=(1,), parent=None, token_ids=toks[:4],
                                         block_size=BS, cache_salt="t")]).orphans == 1
    assert ix.apply_events("r3", [Stored(block_hashes=(1,), parent=None, token_ids=toks,
                                         block_size=BS)]).orphans == 1


def test_removal_cleared_and_clear() -> None:
    ix = KvIndex("m", max_blocks=100)
    toks = tuple(_tokens(2))
    keys = _keys(ix, list(toks))
    ix.apply_events("r1", [Stored(block_hashes=(1, 2), parent=None, token_ids=toks, block_size=BS)])
    ix.apply_events("r2", [Stored(block_hashes=(1, 2), parent=None, token_ids=toks, block_size=BS)])
    ix.apply_events("r1", [Removed(block_hashes=(2,))])
    assert ix.match(keys, 0.0) == {"r1": 1, "r2": 2}
    assert ix.apply_events("r1", [Removed(block_hashes=(2, 99))]).removed == 0
    ix.apply_events("r2", [Cleared()])
    assert ix.match(keys, 0.0) == {"r1": 1}
    ix.clear("r1")
    assert ix.match(keys, 0.0) == {} and ix.replicas() == ["r2"]


def test_a_key_held_by_two_kv_groups_stays_until_both_go() -> None:
    ix = KvIndex("m", max_blocks=100)
    toks = tuple(_tokens(1))
    for g in (0, 1):
        ix.apply_events("r1", [Stored(block_hashes=(5,), parent=None, token_ids=toks, block_size=BS, group=g)])
    ix.apply_events("r1", [Removed(block_hashes=(5,), group=0)])
    assert ix.match(_keys(ix, list(toks)), 0.0) == {"r1": 1}
    ix.apply_events("r1", [Removed(block_hashes=(5,), group=1)])
    assert ix.match(_keys(ix, list(toks)), 0.0) == {}


def test_the_bound_evicts_the_least_recently_stored() -> None:
    ix = KvIndex("m", max_blocks=2)
    a, b, c = (tuple(_tokens(1, base)) for base in (0, 100, 200))
    ix.apply_events("r1", [Stored(block_hashes=(1,), parent=None, token_ids=a, block_size=BS),
                           Stored(block_hashes=(2,), parent=None, token_ids=b, block_size=BS),
                           # vLLM announces a reused block again: block 1 is touched.
                           Stored(block_hashes=(1,), parent=None, token_ids=a, block_size=BS)])
    out = ix.apply_events("r1", [Stored(block_hashes=(3,), parent=None, token_ids=c, block_size=BS)])
    assert out.evicted == 1 and ix.size("r1") == 2
    assert ix.match(_keys(ix, list(a)), 0.0) == {"r1": 1}
    assert ix.match(_keys(ix, list(b)), 0.0) == {}


def test_speculative_entries_expire_and_are_bounded() -> None:
    ix = KvIndex("m", max_blocks=3)
    keys = _keys(ix, _tokens(2))
    ix.speculate("r1", keys, now=10.0, ttl=2.0)
    assert ix.match(keys, now=11.9) == {"r1": 2}
    assert ix.match(keys, now=12.0) == {}
    ix.speculate("r1", _keys(ix, _tokens(5, 1000)), now=20.0, ttl=2.0)
    assert ix.speculative_size("r1") == 3
    # Stored blocks and speculative keys make one run together.
    ix.apply_events("r2", [Stored(block_hashes=(1,), parent=None, token_ids=tuple(_tokens(1)), block_size=BS)])
    ix.speculate("r2", keys[1:], now=20.0, ttl=2.0)
    assert ix.match(keys, now=21.0)["r2"] == 2


# -- properties ------------------------------------------------------------------------

REPLICAS = ["a", "b", "c"]
HASHES = st.integers(0, 12)


@st.composite
def _stored(draw: st.DrawFn) -> Stored:
    n = draw(st.integers(1, 3))
    return Stored(block_hashes=tuple(draw(st.lists(HASHES, min_size=n, max_size=n))),
                  parent=draw(st.none() | HASHES),
                  token_ids=tuple(draw(st.lists(st.integers(0, 3), min_size=n * BS, max_size=n * BS))),
                  block_size=BS, group=draw(st.none() | st.just(1)))


_event = st.one_of(_stored(), st.builds(Removed, block_hashes=st.lists(HASHES, max_size=3).map(tuple),
                                        group=st.none() | st.just(1)), st.just(Cleared()))
_stream = st.lists(st.tuples(st.sampled_from(REPLICAS), _event), max_size=40)
_query = st.lists(st.integers(0, 3), min_size=BS, max_size=5 * BS)


@settings(max_examples=400, deadline=None)
@given(_stream, st.integers(1, 6), st.lists(_query, min_size=1, max_size=4))
def test_the_index_names_only_replicas_the_events_named_and_keeps_its_bound(
    stream: list[tuple[str, Event]], bound: int, queries: list[list[int]]
) -> None:
    ix = KvIndex("m", max_blocks=bound)
    named: set[str] = set()
    for replica, e in stream:
        ix.apply_events(replica, [e])
        named.add(replica)
        assert ix.size(replica) <= bound
    for q in queries:
        keys = _keys(ix, q)
        got = ix.match(keys, 0.0)
        assert set(got) <= named
        assert all(0 < n <= len(keys) for n in got.values())


@settings(max_examples=300, deadline=None)
@given(_stream, st.sampled_from(REPLICAS), st.booleans(), st.lists(_query, min_size=1, max_size=4))
def test_after_cleared_or_clear_a_replica_matches_nothing(
    stream: list[tuple[str, Event]], victim: str, by_event: bool, queries: list[list[int]]
) -> None:
    ix = KvIndex("m", max_blocks=50)
    for replica, e in stream:
        ix.apply_events(replica, [e])
    if by_event:
        ix.apply_events(victim, [Cleared()])
    else:
        ix.clear(victim)
    assert ix.size(victim) == 0
    for q in queries:
        assert victim not in ix.match(_keys(ix, q), 0.0)


@settings(max_examples=300, deadline=None)
@given(st.lists(_stored(), min_size=1, max_size=6), st.lists(_query, min_size=1, max_size=4))
def test_stored_then_removed_leaves_no_match(stored: list[Stored], queries: list[list[int]]) -> None:
    ix = KvIndex("m", max_blocks=1000)
    ix.apply_events("a", stored)
    ix.apply_events("a", [Removed(block_hashes=s.block_hashes, group=s.group) for s in stored])
    assert ix.size("a") == 0
    for q in queries:
        assert ix.match(_keys(ix, q), 0.0) == {}
