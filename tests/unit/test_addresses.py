"""One address grammar (config/addresses.py): what a config check accepts is what the
dialler dials, what ctl takes, and what a listener binds (issue 21)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.config.addresses import AddressError, is_wildcard, parse_host_port, parse_tcp
from llmgw.config.checks import check_host_port, check_tcp_address
from llmgw.errors import ConfigError
from llmgw.transport.client import check_address
from llmgw.transport.requests import Endpoint


def config_accepts(value: str) -> bool:
    try:
        check_tcp_address("agent.yaml", "server", value)
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("good", [
    "tcp://127.0.0.1:7443", "tcp://llmgw-server.internal:7443", "tcp://[::1]:1",
    "tcp://gpu_07.rack-3:65535", "tcp://[fe80::1]:7443", "tcp://a:1",
])
def test_good_addresses(good: str) -> None:
    assert config_accepts(good) and check_address(good) is None


@pytest.mark.parametrize(("bad", "words"), [
    ("tcp://gpu+a:7443", "not a host name"),  # passed the config check, failed when dialled
    ("tcp://-a:7443", "not a host name"),
    ("tcp://a..b:7443", "not a host name"),
    ("tcp://999.1.1.1:7443", "not an IPv4 address"),
    ("tcp://::1:7443", "IPv6 address goes in brackets"),
    ("tcp://[::g]:7443", "not an IPv6 address"),
    ("tcp://h:0", "outside 1..65535"),
    ("tcp://h:70000", "outside 1..65535"),
    ("tcp://h:x", "not a number"),
    ("tcp://h", "tcp://HOST:PORT"),
    ("tcp://*:7443", "not a host name"),  # a dialler cannot dial every interface
    ("http://127.0.0.1:7443", "not HTTP"),
    ("127.0.0.1:7443", "tcp://HOST:PORT"),
    ("", "tcp://HOST:PORT"),
])
def test_bad_addresses_are_refused_the_same_everywhere(bad: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_tcp_address("agent.yaml", "server", bad)
    assert words in str(info.value) and str(info.value).startswith("agent.yaml: server: ")
    assert words in (check_address(bad) or "")


def test_a_zeromq_bind_may_name_every_interface_an_http_one_as_the_socket_calls_do() -> None:
    assert parse_tcp("tcp://*:7443", listen=True) == ("*", 7443)
    assert is_wildcard(parse_tcp("tcp://[::]:7443", listen=True)[0])
    assert is_wildcard(parse_tcp("tcp://0.0.0.0:7443", listen=True)[0])
    assert not is_wildcard(parse_tcp("tcp://10.0.0.1:7443", listen=True)[0])
    check_host_port("router.toml", "bind", "0.0.0.0:8080")
    assert parse_host_port("[::1]:8080") == ("::1", 8080)
    with pytest.raises(ConfigError, match="router.toml: bind: .*not a host name"):
        check_host_port("router.toml", "bind", "*:8080")
    # Port 0 (the kernel picks) only for a listener made in code, never from a file.
    assert parse_host_port("127.0.0.1:0", any_port=True) == ("127.0.0.1", 0)
    with pytest.raises(ConfigError, match="port 0 is outside 1..65535"):
        check_host_port("router.toml", "bind", "127.0.0.1:0")


def test_engine_urls_use_the_same_hosts() -> None:
    assert Endpoint("r", "http://10.0.0.1:8000").url == "http://10.0.0.1:8000"
    assert Endpoint("r", "http://[::1]:8000/").url == "http://[::1]:8000/"
    for bad in ("http://gpu+a:8000", "http://h:0", "https://h:1", "http://h"):
        with pytest.raises(ValueError, match="not an engine URL"):
            Endpoint("r", bad)


@given(st.text(alphabet="tcp:/[]*.-_+ 0123456789abfg:\x00é", max_size=30))
def test_config_and_dialler_agree_on_any_text(value: str) -> None:
    accepted = config_accepts(value)
    assert accepted == (check_address(value) is None)
    if accepted:
        host, port = parse_tcp(value)
        assert 1 <= port <= 65535 and host and "+" not in host


@given(st.text(max_size=40))
def test_parsers_are_total(value: str) -> None:
    for parse in (parse_tcp, parse_host_port):
        try:
            parse(value)
        except AddressError as exc:
            assert str(exc)  # refused, in words: what the callers turn into their errors
