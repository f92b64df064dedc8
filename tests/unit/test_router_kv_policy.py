"""The kv_aware policy (llmgw.router.kv.policy): a model's tokenizer read from its folder
(or why not), the table's relays, a request's block keys, and the choice: the replica that
holds the prompt's leading blocks unless its load outweighs them, the rest of a burst
following it by speculation, and the fallbacks counted."""

from __future__ import annotations

import random
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest

from fakes.kv_tokenizer import ids, write_tokenizer
from llmgw.config.router import ModelRouteConfig
from llmgw.kvcache import blocks
from llmgw.kvcache.events import Batch, Stored
from llmgw.kvcache.tokenize import PromptTokenizer, Unavailable
from llmgw.router.kv import policy
from llmgw.router.kv.policy import INLINE_MAX_BYTES, KvModel, KvRouting, read_tokenizer
from llmgw.router.routing.balancer import Pool, Replica
from llmgw.transport.requests import Endpoint, KvRelay

BS = 4  # block size
PREFIX = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11"  # with the BOS: 3 full blocks


def Row(replica_id: str, kv: KvRelay | None = None) -> Endpoint:  # noqa: N802 - reads as a row
    return Endpoint(replica_id, f"http://10.0.1.1:{8000 + len(replica_id)}", kv=kv)


def Kv(endpoint: str, key: str) -> KvRelay:  # noqa: N802
    return KvRelay(endpoint, key * 20)


def routing(tmp_path: Path, **route: Any) -> KvRouting:
    folder = write_tokenizer(tmp_path / "tok")
    cfg = ModelRouteConfig(policy="kv_aware", tokenizer=str(folder), **route)
    return KvRouting({"m": cfg, "plain": ModelRouteConfig()})


def stored(text: str, parent: int | None = None, start: int = 0) -> Batch:
    """The engine's BlockStored for the full blocks of `text`'s ids (engine hashes 1000+)."""
    toks = ids(text)
    n = len(toks) // BS
    hashes = tuple(1000 + start + i for i in range(n))
    return Batch(0.0, 0, None, (Stored(hashes, parent, tuple(toks[: n * BS]), BS),))


def pool(*loads: int) -> Pool:
    rs = []
    for i, out in enumerate(loads):
        r = Replica(f"r{i}", f"http://127.0.0.1:{9000 + i}")
        r.outstanding = out
        rs.append(r)
    return Pool(rs, affinity=True, rng=random.Random(1))


async def keys(kv: KvRouting, text: str, model: str = "m", base: str | None = None) -> tuple[KvModel, list[int]]:
    got = await kv.keys(model, base, {"model": model, "prompt": text}, len(text), b"/v1/completions")
    assert got is not None
    return got


# ---------------------------------------------------------------------------------------
# The tokenizer folder


def test_read_tokenizer_reads_the_folder(tmp_path: Path) -> None:
    tok = read_tokenizer(str(write_tokenizer(tmp_path / "t")))
    assert isinstance(tok, PromptTokenizer)
    assert tok.encode_completion("w1 w2") == ids("w1 w2")


def test_read_tokenizer_takes_the_template_files_too(tmp_path: Path) -> None:
    folder = write_tokenizer(tmp_path / "t")
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("tools: {{ tools | length }}")
    (folder / "model.safetensors").write_bytes(b"not read")
    tok = read_tokenizer(str(folder))
    assert isinstance(tok, PromptTokenizer)
    assert tok.render_chat([{"role": "user", "content": "w1 w2"}], now=datetime.now()) == "w1 w2"
    assert tok.render_chat([{"role": "user", "content": "w1"}], now=datetime.now(),
                           tools=[{"type": "function"}]) == "tools: 1"


@pytest.mark.parametrize(("make", "why"), [
    (lambda p: p / "absent", "cannot read"),
    (lambda p: p, "no tokenizer.json"),
])
def test_read_tokenizer_says_why_not(tmp_path: Path, make: Any, why: str) -> None:
    got = read_tokenizer(str(make(tmp_path)))
    assert isinstance(got, Unavailable) and why in got.reason


def test_a_model_without_its_tokenizer_is_left_to_prefix_affinity_and_counted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    kv = KvRouting({"m": ModelRouteConfig(policy="kv_aware", tokenizer=str(tmp_path / "none"))})
    assert kv.on and kv.models == {} and "cannot read" in kv.unavailable["m"]
    assert "kv_aware routing is off, prefix_affinity instead" in caplog.text
    assert trio.run(kv.keys, "m", None, {"prompt": "w1"}, 2, b"/v1/completions") is None
    text = render(kv)
    assert 'llmgw_router_kv_tokenizer_unavailable{model="m"} 1.0' in text
    assert 'llmgw_router_kv_fallbacks_total{model="m",why="tokenizer"} 1.0' in text


def test_no_kv_aware_model_no_routing(tmp_path: Path) -> None:
    kv = KvRouting({"plain": ModelRouteConfig(policy="prefix_affinity")})
    assert not kv.on


def render(kv: KvRouting) -> str:
    reg = CollectorRegistry()

    class C:
        def collect(self) -> Any:
            return kv.families()

    reg.register(C())
    return generate_latest(reg).decode()


# ---------------------------------------------------------------------------------------
# The table


def test_the_table_names_the_relays_to_follow_and_forgets_replicas_that_left(tmp_path: Path) -> None:
    kv = routing(tmp_path)
    first = kv.changed
    kv.table_changed({"m": [Row("r0", Kv("tcp://10.0.0.1:7444", "K1")), Row("r1", Kv("tcp://10.0.0.1:7444", "K1")),
                            Row("r2", Kv("tcp://10.0.0.2:7444", "K2")), Row("r3")],
                      "plain": [Row("p0", Kv("tcp://10.0.0.3:7444", "K3"))]})
    assert first.is_set()
    assert kv.agents == {("tcp://10.0.0.1:7444", "K1" * 20): {"r0", "r1"},
                         ("tcp://10.0.0.2:7444", "K2" * 20): {"r2"}}
    assert kv.model_of("r3") is kv.models["m"] and kv.model_of("p0") is None
    km = kv.models["m"]
    km.index.apply("r0", stored(PREFIX))
    again = kv.changed
    kv.table_changed({"m": [Row("r0", Kv("tcp://10.0.0.1:7444", "K1")), Row("r1", Kv("tcp://10.0.0.1:7444", "K1")),
                            Row("r2", Kv("tcp://10.0.0.2:7444", "K2")), Row("r3")]})
    assert again.is_set()  # the same relays, but a new table: the links look again
    assert km.index.size("r0") == 3
    kv.table_changed({"m": [Row("r1", Kv("tcp://10.0.0.1:7444", "K1"))]})
    assert kv.agents == {("tcp://10.0.0.1:7444", "K1" * 20): {"r1"}}
    assert km.index.size("r0") == 0 and kv.model_of("r0") is None


# ---------------------------------------------------------------------------------------
# Requests


def pick(kv: KvRouting, km: KvModel, k: list[int], p: Pool, now: float, stale: float,
         exclude: tuple[Replica, ...]) -> Replica:
    r = kv.choose(km, k, p, now, stale, exclude)
    assert r is not None
    return r


async def test_no_block_size_yet_falls_back(tmp_path: Path) -> None:
    kv = routing(tmp_path)
    assert await kv.keys("m", None, {"prompt": PREFIX}, 10, b"/v1/completions") is None
    assert kv.models["m"].fallbacks == {"no_block_size": 1}


async def test_keys_chain_the_prompt_as_the_index_chains_the_events(tmp_path: Path) -> None:
    kv = routing(tmp_path)
    km = kv.models["m"]
    km.index.apply("r1", stored(PREFIX))
    got_model, got = await keys(kv, PREFIX + " w50 w51")
    assert got_model is km
    assert got == blocks.chain_keys(ids(PREFIX + " w50 w51"), BS, km.index.seed(None))
    assert km.index.match(got, 0.0) == {"r1": 3}


async def test_a_long_prompt_is_tokenized_in_a_thread_with_the_same_keys(tmp_path: Path) -> None:
    kv = routing(tmp_path)
    kv.models["m"].index.apply("r1", stored(PREFIX))
    text = " ".join(f"w{i % 200}" for i in range(1000))  # over INLINE_MAX_BYTES
    _, inline = await keys(kv, text[:1999].rsplit(" ", 1)[0])
    _, threaded = await keys(kv, text)
    assert len(threaded) == 250 and threaded[: len(inline)] == inline


async def test_chat_bodies_are_rendered_as_the_engine_renders_them(tmp_path: Path) -> None:
    kv = routing(tmp_path)
    km = kv.models["m"]
    km.index.apply("r1", stored(PREFIX))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "w1 w2 w3 w4 w5"}]
    body = {"model": "m", "messages": messages}
    got = await kv.keys("m", None, body, 10, b"/v1/chat/completions")
    assert got is not None
    chat_ids = km.tok.encode_chat(messages, now=datetime.now())
    assert got[1] == blocks.chain_keys(chat_ids, BS, km.index.seed(None))


@pytest.mark.parametrize(("body", "path"), [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     b"/v1/chat/completions"),
    ({"messages": "hi"}, b"/v1/chat/completions"),
    ({"prompt": None}, b"/v1/completions"),
    ({"prompt": [{"a": 1}]}, b"/v1/completions"),
    ({"input": "w1"}, b"/v1/embeddings"),
])
async def test_prompts_not_tokenized_fall_back(tmp_path: Path, body: dict[str, Any], path: bytes) -> None:
    kv = routing(tmp_path)
    kv.models["m"].index.apply("r1", stored(PREFIX))
    assert await kv.keys("m", None, body, 10, path) is None
    assert kv.models["m"].fallbacks == {"not_text": 1}


async def test_an_adapter_uses_its_base_index_with_its_own_seed(tmp_path: Path) -> None:
    kv = routing(tmp_path)
    km = kv.models["m"]
    km.index.apply("r1", stored(PREFIX))
    got_model, got = await keys(kv, PREFIX, model="sql-lora", base="m")
    assert got_model is km
    assert got == blocks.chain_keys(ids(PREFIX), BS, km.index.seed("sql-lora"))
    assert km.index.match(got, 0.0) == {}  # the base's blocks are not the adapter's
    assert await kv.keys("other-lora", "plain", {"prompt": "w1"}, 2, b"/v1/completions") is None


async def test_the_replica_holding_the_prefix_wins_unless_its_load_outweighs_it(tmp_path: Path) -> None:
    kv = routing(tmp_path, kv_weight=1.0, kv_speculative_ttl=0.0)
    km = kv.models["m"]
    km.index.apply("r1", stored(PREFIX))
    _, k = await keys(kv, PREFIX + " w60")  # 3 blocks, all on r1
    assert pick(kv, km, k, pool(0, 2, 0), 0.0, 2.0, ()).replica_id == "r1"  # 3 uncached > 2 more load
    assert pick(kv, km, k, pool(0, 4, 0), 0.0, 2.0, ()).replica_id == "r0"  # 4 more load > 3 blocks
    assert (km.routed, km.prompt_blocks, km.hit_blocks) == (2, 6, 3)
    p = pool(0, 0, 0)
    assert pick(kv, km, k, p, 0.0, 2.0, (p.replicas[1],)).replica_id == "r0"  # a retry elsewhere


async def test_a_burst_follows_the_first_choice_by_speculation(tmp_path: Path) -> None:
    kv = routing(tmp_path, kv_weight=1.0, kv_speculative_ttl=2.0)
    km = kv.models["m"]
    km.index.apply("r9", stored("w100 w101 w102 w103"))  # a block size, nothing of this prefix
    _, k = await keys(kv, PREFIX)
    p = pool(0, 0, 0)
    first = pick(kv, km, k, p, 10.0, 2.0, ())
    first.outstanding += 1  # dispatched
    assert pick(kv, km, k, p, 11.0, 2.0, ()) is first  # held by speculation: 3 blocks > 1 load
    assert km.hit_blocks == 3
    assert pick(kv, km, k, pool(0, 0, 1), 12.5, 2.0, ()).replica_id == "r0"  # expired


async def test_one_eligible_replica_is_chosen_with_its_prediction_counted(tmp_path: Path) -> None:
    """No choice, but the predicted hits are counted still (a model of one replica has its
    predicted hit rate beside the engine's own); none eligible is the pool's own answer."""
    kv = routing(tmp_path)
    km = kv.models["m"]
    km.index.apply("r1", stored(PREFIX))
    _, k = await keys(kv, PREFIX)
    p = pool(0, 0)
    assert pick(kv, km, k, p, 0.0, 2.0, (p.replicas[0],)) is p.replicas[1]
    assert (km.routed, km.hit_blocks, km.prompt_blocks) == (1, 3, 3)
    assert kv.choose(km, k, p, 0.0, 2.0, tuple(p.replicas)) is None
    assert km.routed == 1


async def test_metrics_say_the_predicted_hits_and_the_index(tmp_path: Path) -> None:
    kv = routing(tmp_path, kv_weight=1.0)
    km = kv.models["m"]
    km.index.apply("r1", stored(PREFIX))
    _, k = await keys(kv, PREFIX)
    pick(kv, km, k, pool(0, 0), 0.0, 2.0, ())
    text = render(kv)
    for line in ('llmgw_router_kv_predicted_hit_blocks_total{model="m"} 3.0',
                 'llmgw_router_kv_prompt_blocks_total{model="m"} 3.0',
                 'llmgw_router_kv_routed_total{model="m"} 1.0',
                 'llmgw_router_kv_index_blocks{model="m"} 3.0'):
        assert line in text, text


async def test_only_a_long_body_is_tokenized_off_the_event_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kv = routing(tmp_path)
    kv.models["m"].index.apply("r1", stored(PREFIX))
    threads: list[int] = []
    real = policy._keys

    def spy(*args: Any) -> Any:
        threads.append(threading.get_ident())
        return real(*args)

    monkeypatch.setattr(policy, "_keys", spy)
    await kv.keys("m", None, {"prompt": PREFIX}, INLINE_MAX_BYTES, b"/v1/completions")
    await kv.keys("m", None, {"prompt": PREFIX}, INLINE_MAX_BYTES + 1, b"/v1/completions")
    assert threads[0] == threading.get_ident() and threads[1] != threading.get_ident()
