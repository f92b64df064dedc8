import pytest

from llmgw.errors import UsageError
from llmgw.simengine.api import continued
from llmgw.simengine.args import VLLM_DEFAULT_MASTER_PORT, parse_args


def test_vllm_single_node() -> None:
    a = parse_args(
        "serve org/m --host 10.0.0.1 --port 8001 --served-model-name m --tensor-parallel-size 4".split(),
        {},
    )
    assert a.shape == "vllm"
    assert (a.model, a.served_names, a.host, a.port) == ("org/m", ("m",), "10.0.0.1", 8001)
    assert a.tensor_parallel == 4 and a.nnodes == 1 and not a.is_gang and a.serves_api
    assert a.unknown == ()


def test_vllm_mp_headless_member() -> None:
    a = parse_args(
        "serve /models/m --tensor-parallel-size 8 --pipeline-parallel-size 2 --nnodes 2 "
        "--node-rank 1 --master-addr 10.0.0.1 --master-port 29600 --headless".split(),
        {},
    )
    assert a.nnodes == 2 and a.node_rank == 1 and a.headless and not a.serves_api
    assert (a.rendezvous_host, a.rendezvous_port) == ("10.0.0.1", 29600)
    assert a.pipeline_parallel == 2 and a.served_names == ("/models/m",)


def test_vllm_mp_default_master_port() -> None:
    a = parse_args("serve m --nnodes 2 --node-rank 0 --master-addr 10.0.0.1".split(), {})
    assert a.rendezvous_port == VLLM_DEFAULT_MASTER_PORT and a.serves_api


def test_vllm_ray_backend_and_unknown_flags_kept() -> None:
    a = parse_args(
        "serve m --port 9 --distributed-executor-backend ray --max-model-len 4096 "
        "--enable-prefix-caching --foo=bar".split(),
        {},
    )
    assert a.executor_backend == "ray"
    assert a.unknown == ("--max-model-len", "4096", "--enable-prefix-caching", "--foo=bar")


def test_sglang_shape_multi_node() -> None:
    a = parse_args(
        "--model-path org/m --served-model-name m --host 10.0.0.2 --port 30001 --tp 8 "
        "--nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.1:5000".split(),
        {},
    )
    assert a.shape == "sglang"
    assert (a.model, a.served_name, a.port, a.tensor_parallel) == ("org/m", "m", 30001, 8)
    assert (a.rendezvous_host, a.rendezvous_port, a.node_rank) == ("10.0.0.1", 5000, 1)
    assert a.is_gang and not a.serves_api


def test_knobs_from_env_and_flags() -> None:
    env = {
        "LLMGW_SIM_LOAD_SECONDS": "1.5",
        "LLMGW_SIM_TOKENS_PER_SECOND": "20",
        "LLMGW_SIM_TTFT": "0.25",
        "LLMGW_SIM_TOKENS": "7",
        "LLMGW_SIM_EXIT_AFTER": "3",
        "LLMGW_SIM_IGNORE_SIGTERM": "1",
    }
    a = parse_args(["serve", "m"], env)
    assert (a.load_seconds, a.tokens_per_second, a.ttft, a.tokens) == (1.5, 20.0, 0.25, 7)
    assert a.exit_after == 3.0 and a.ignore_sigterm
    b = parse_args(["serve", "m", "--sim-tokens-per-second", "5"], env)
    assert b.tokens_per_second == 5.0
    c = parse_args(["serve", "m"], {})
    assert c.exit_after is None and not c.ignore_sigterm and c.load_seconds == 0.0
    assert c.die_after_tokens == 0
    assert parse_args(["serve", "m"], {"LLMGW_SIM_DIE_AFTER_TOKENS": "5"}).die_after_tokens == 5
    assert parse_args(["serve", "m", "--sim-die-after-tokens", "2"], {}).die_after_tokens == 2


@pytest.mark.parametrize(("text", "start"), [
    ("hello", 0),
    ("the", 1),
    ("Say: the quick brown", 3),
    ("the quick brown fox jumps over a lazy dog again the quick", 12),
    ("quick", 0),  # not the text's start
    ("the quick brown fox jumps over a lazy dog again the quick brown fox jumps over", 16),
])
def test_simulated_answer_goes_on_from_its_own_start(text: str, start: int) -> None:
    assert continued(text, 16) == start


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["serve"],
        ["--model-path", "m", "--dist-init-addr", "nohost"],
        ["serve", "m", "--nnodes", "2", "--node-rank", "2"],
        ["serve", "m", "--port", "x"],
    ],
)
def test_bad_command_lines(argv: list[str]) -> None:
    with pytest.raises(UsageError):
        parse_args(argv, {})


def test_bad_env_knob() -> None:
    with pytest.raises(UsageError, match="LLMGW_SIM_TTFT"):
        parse_args(["serve", "m"], {"LLMGW_SIM_TTFT": "soon"})
