"""`llmgw config example`: the annotated files of conf/ and systemd/, as installed.

conf/ and systemd/ in the repository are the one source. pip installs them as data files
(pyproject.toml, [tool.setuptools.data-files]) under PREFIX/share/llmgw/, and the README
under PREFIX/share/doc/llmgw/; they are found through the installed distribution's file
list, so a venv, a --user install and /usr/local all work. A source checkout (an editable
install) reads the repository's own folders instead.

`agent-no-ib` is not a file of its own: it is conf/agent.yaml with its `fabrics:` block
commented out (without_infiniband), so the two cannot drift apart.

Nothing of the daemons is imported here: printing an example needs no configuration.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path, PurePosixPath

from attrs import frozen

from llmgw.errors import EXIT_USAGE, LlmgwError, UsageError

DIST = "llmgw"
SHARE = PurePosixPath("share") / "llmgw"


@frozen
class Example:
    name: str
    relpath: str  # inside the repository, and inside share/llmgw/ once installed
    about: str
    no_infiniband: bool = False  # print it through without_infiniband()


EXAMPLES: tuple[Example, ...] = (
    Example("agent", "conf/agent.yaml", "agent.yaml, one per GPU node (its HCAs labelled into fabrics)"),
    Example("agent-no-ib", "conf/agent.yaml", "agent.yaml for a node without InfiniBand (no fabrics)",
            no_infiniband=True),
    Example("server", "conf/server.toml", "server.toml, the control plane"),
    Example("router", "conf/router.toml", "router.toml, the OpenAI-compatible front door"),
    Example("deployment", "conf/deployments/llama-70b.yaml", "a vLLM deployment (ctl apply -f)"),
    Example("deployment-demo", "conf/deployments/demo.yaml", "the simulated deployment of llmgw dev"),
    Example("deployment-multinode", "conf/deployments/llama-405b.yaml",
            "a vLLM replica across nodes of one fabric"),
    Example("deployment-sglang", "conf/deployments/qwen-sglang.yaml", "an SGLang deployment"),
    Example("deployment-lora", "conf/deployments/llama-8b-lora.yaml",
            "a vLLM deployment serving LoRA adapters by name"),
    Example("deployment-autoscale", "conf/deployments/llama-8b-autoscale.yaml",
            "a vLLM deployment whose replicas follow load, to zero and back"),
    Example("grafana", "conf/grafana/llmgw.json", "the Grafana dashboard"),
    Example("server-unit", "systemd/llmgw-server.service", "systemd unit of the server"),
    Example("agent-unit", "systemd/llmgw-agent.service", "systemd unit of the agent"),
    Example("router-unit", "systemd/llmgw-router.service", "systemd unit of the router"),
    Example("sysusers", "systemd/llmgw.sysusers.conf", "sysusers.d file creating the llmgw user"),
)
BY_NAME = {e.name: e for e in EXAMPLES}


class ExampleMissingError(LlmgwError):
    """The installed package lacks a file it should have shipped: a broken install, to
    repair on this machine (exit 2, as a configuration to fix is)."""

    exit_code = EXIT_USAGE


def _source_tree() -> Path | None:
    """The repository this module runs from (editable install or checkout), if any."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "conf").is_dir():
        return root
    return None


def _installed(relpath: PurePosixPath) -> Path | None:
    """Where pip put a data file of ours, from the distribution's RECORD."""
    try:
        dist = importlib.metadata.distribution(DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        parts = PurePosixPath(f.as_posix()).parts
        # RECORD names data files relative to site-packages: ../../../share/llmgw/conf/x
        tail = PurePosixPath(*[p for p in parts if p != ".."])
        if tail == relpath:
            return Path(str(dist.locate_file(f))).resolve()
    return None


def locate(relpath: str) -> Path:
    """A file of conf/ or systemd/ (or README.md), from the checkout or the install."""
    tree = _source_tree()
    if tree is not None and (tree / relpath).is_file():
        return tree / relpath
    installed = PurePosixPath("share/doc/llmgw/README.md") if relpath == "README.md" else SHARE / relpath
    found = _installed(installed)
    if found is None or not found.is_file():
        raise ExampleMissingError(
            f"{installed} is not installed with llmgw (reinstall it with pip: the file ships "
            "as a data file of the package)"
        )
    return found


def example_text(name: str) -> str:
    ex = BY_NAME.get(name)
    if ex is None:
        raise UsageError(f"config example: no example named {name!r} (one of: {', '.join(BY_NAME)})")
    text = locate(ex.relpath).read_text(encoding="utf-8")
    return without_infiniband(text) if ex.no_infiniband else text


def listing() -> str:
    width = max(len(e.name) for e in EXAMPLES)
    lines = ["examples (llmgw config example NAME > FILE):"]
    lines += [f"  {e.name:<{width}}  {e.about}" for e in EXAMPLES]
    return "\n".join(lines) + "\n"


NO_IB_NOTE = """\
# Done here (`llmgw config example agent-no-ib`): no fabrics, so this node is an
# island that hosts single-node replicas only. A node with HCAs labels them, as in:
"""


def without_infiniband(text: str) -> str:
    """The agent example with its `fabrics:` block commented out and `fabrics: []` put in
    its place: a config that loads and runs on a node without HCAs. Pure."""
    lines = text.splitlines(keepends=True)
    try:
        start = next(i for i, line in enumerate(lines) if line.rstrip() == "fabrics:")
    except StopIteration:
        raise ExampleMissingError("the agent example has no top-level `fabrics:` block") from None
    end = start + 1
    while end < len(lines) and lines[end].startswith((" ", "\t")) and lines[end].strip():
        end += 1
    block = ["# " + line if line.strip() else line for line in lines[start:end]]
    return "".join([*lines[:start], "fabrics: []\n", NO_IB_NOTE, *block, *lines[end:]])
