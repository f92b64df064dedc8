"""How deep a JSON body nests, found without recursion and with bounded work, before json.loads.

`json.loads` recurses once per nesting level: a body nested 100,000 deep ends in
RecursionError. `too_deep(body)` answers whether the body's arrays and objects nest
deeper than `limit` (outside strings) without recursing. For valid JSON it is exact; for
invalid JSON it may over-estimate but never under-estimates the depth of the prefix that
json.loads would read before failing, so json.loads never goes deeper than `limit`.

How, all in C-speed bytes operations but for one loop over runs of brackets:
1. a body with at most `limit` opening brackets in all is answered at once (the common
   case: two `bytes.count`);
2. escaped backslashes and quotes are removed, then every byte but quotes and brackets
   (`{}` become `[]`: only the depth counts), then what lies between pairs of quotes (the
   strings), which leaves the brackets outside strings;
3. a run of more than `limit` opening brackets answers at once (the usual attack);
4. PASSES times, every adjacent `[]` is removed: each pass lowers the depth by exactly
   one (every deepest bracket is part of such a pair), and most bodies are empty by then;
5. what is left is walked run by run (few runs: each left-over peak was more than
   PASSES deep), adding the PASSES levels removed.
"""

from __future__ import annotations

import re

MAX_DEPTH = 128
PASSES = 8

_KEEP = b'"[]{}'
_DROP = bytes(b for b in range(256) if b not in _KEEP)
_SAME = bytes.maketrans(b"{}", b"[]")
_RUNS = re.compile(rb"\[+|\]+")


def too_deep(body: bytes, limit: int = MAX_DEPTH) -> bool:
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    s = body.replace(b"\\\\", b"").replace(b'\\"', b"").translate(_SAME, _DROP)
    s = b"".join(s.split(b'"')[::2])  # what lies outside strings
    if b"[" * (limit + 1) in s:
        return True
    passes = 0
    while passes < PASSES and passes < limit:
        if not s:
            return False
        shorter = s.replace(b"[]", b"")
        if len(shorter) == len(s):
            break  # no pair left: only closing before opening brackets (not JSON)
        s = shorter
        passes += 1
    depth = 0
    top = limit - passes
    for m in _RUNS.finditer(s):
        if s[m.start()] == 0x5B:  # "["
            depth += m.end() - m.start()
            if depth > top:
                return True
        else:
            depth -= m.end() - m.start()
    return False
