"""The documentation kept in step with the code: the README's two commands are the ones
CI runs and pyproject.toml makes possible, and docs/configuration.md names every key the
configuration loaders accept, and no key they refuse."""

from __future__ import annotations

import re
import shlex
import tomllib
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import yaml

from llmgw import cli
from llmgw.config import autoscale as autoscale_cfg
from llmgw.config import deployment as deployment_cfg
from llmgw.config import load_agent, load_router, load_server
from llmgw.config.agent import AgentConfig
from llmgw.config.error_paths import structure_file
from llmgw.config.router import RouterConfig
from llmgw.config.server import ServerConfig

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
CONFIG_DOC = REPO / "docs" / "configuration.md"

RUN_COMMAND = "pip install -e . && llmgw dev"
TEST_COMMAND = "pip install -e '.[test]' && pytest"


def _sh_blocks(text: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"```sh\n(.*?)```", text, re.S)]


def test_readme_holds_the_two_commands() -> None:
    blocks = _sh_blocks(README.read_text())
    assert RUN_COMMAND in blocks
    assert TEST_COMMAND in blocks


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run runs the README's test command, quieted: the same words once `--quiet` and
    `-q` are taken out."""
    quiet = {"--quiet", "-q"}
    want = shlex.split(TEST_COMMAND)
    for line in (REPO / ".ci" / "run").read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        if [w for w in shlex.split(line) if w not in quiet] == want:
            return
    raise AssertionError(f".ci/run has no line running {TEST_COMMAND!r}")


def test_pyproject_makes_the_commands_possible() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "test" in project["optional-dependencies"]
    assert "pytest" in " ".join(project["optional-dependencies"]["test"])
    assert project["scripts"]["llmgw"] == "llmgw.cli:main"
    assert cli.build_parser().parse_args(["dev"]).func is cli.cmd_dev


# --- docs/configuration.md against the loaders -------------------------------------------

def _attrs_keys(cls: type, prefix: str = "") -> Iterator[tuple[str, bool]]:
    """(key as the file writes it, is a leaf) for every field, nested: `engines.vllm.bin`,
    a list of tables as `fabrics[].name`, a table of tables as `models.NAME.policy`."""
    hints = typing.get_type_hints(cls)
    for f in attrs.fields(cls):
        if f.name == "source":  # set by the loader from the path; refused in a file
            continue
        key = prefix + f.name
        t = hints[f.name]
        inner, sep = None, "."
        if attrs.has(t):
            inner = t
        else:
            for a in (t, *typing.get_args(t)):
                args = typing.get_args(a)
                if typing.get_origin(a) is tuple and args and attrs.has(args[0]):
                    inner, sep = args[0], "[]."
                elif typing.get_origin(a) is dict and len(args) == 2 and attrs.has(args[1]):
                    inner, sep = args[1], ".NAME."
        yield key, inner is None
        if inner is not None:
            yield from _attrs_keys(inner, key + sep)


def _deployment_keys() -> Iterator[tuple[str, bool]]:
    for k in deployment_cfg._REQUIRED + deployment_cfg._OPTIONAL:
        yield k, k not in ("autoscale", "adapters")
    for k in autoscale_cfg._KEYS:
        yield f"autoscale.{k}", True
    for k in deployment_cfg._ADAPTER_KEYS:
        yield f"adapters[].{k}", True


SECTIONS: dict[str, Any] = {
    "agent.yaml": lambda: _attrs_keys(AgentConfig),
    "server.toml": lambda: _attrs_keys(ServerConfig),
    "router.toml": lambda: _attrs_keys(RouterConfig),
    "Deployment files": _deployment_keys,
}


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def doc_keys(section: str) -> set[str]:
    """The keys a section's table names: every backticked name in a row's first cell."""
    keys = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            keys.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return keys


def check_doc(text: str) -> list[str]:
    """What docs/configuration.md gets wrong against the code, one line each."""
    sections = _sections(text)
    faults = []
    for name, code_keys in SECTIONS.items():
        if name not in sections:
            faults.append(f"no section '## {name}'")
            continue
        named = doc_keys(sections[name])
        keys = dict(code_keys())
        faults += [f"{name}: {k} is accepted by the loader but not named"
                   for k, leaf in keys.items() if leaf and k not in named]
        faults += [f"{name}: {k} is named but the loader does not accept it"
                   for k in sorted(named - keys.keys())]
    return faults


def test_configuration_doc_names_exactly_the_keys_the_loaders_accept() -> None:
    assert check_doc(CONFIG_DOC.read_text()) == []


def test_a_key_added_to_the_code_but_not_the_doc_is_caught() -> None:
    text = CONFIG_DOC.read_text()
    server = _sections(text)["server.toml"]
    dropped = text.replace(next(ln for ln in server.splitlines() if ln.startswith("| `drain_grace`")), "")
    assert "server.toml: drain_grace is accepted by the loader but not named" in check_doc(dropped)
    added = text.replace("| `bind` | `tcp://0.0.0.0:7443`", "| `bind_twice` | `tcp://0.0.0.0:7443`")
    assert "server.toml: bind_twice is named but the loader does not accept it" in check_doc(added)


def _blocks(section: str, lang: str) -> list[str]:
    return [m.group(1) for m in re.finditer(rf"```{lang}\n(.*?)```", section, re.S)]


def test_configuration_doc_examples_load() -> None:
    """Each example file in the doc goes through its loader's own converter (strict: an
    unknown key, a wrong type, a bad duration fail); the checks that need the machine
    (key files present, ports) are left to the loaders' own tests."""
    sections = _sections(CONFIG_DOC.read_text())
    src = str(CONFIG_DOC)
    agents = _blocks(sections["agent.yaml"], "yaml")
    servers = _blocks(sections["server.toml"], "toml")
    routers = _blocks(sections["router.toml"], "toml")
    deployments = _blocks(sections["Deployment files"], "yaml")
    assert agents and servers and routers and deployments
    for block in agents:
        cfg = structure_file(load_agent._converter(), yaml.safe_load(block), AgentConfig, path=src)
        assert cfg.node_id
    for block in servers:
        structure_file(load_server._converter(), tomllib.loads(block), ServerConfig, path=src)
    for block in routers:
        structure_file(load_router._converter(), tomllib.loads(block), RouterConfig, path=src)
    for block in deployments:
        assert deployment_cfg.parse_deployment(yaml.safe_load(block), src).name
