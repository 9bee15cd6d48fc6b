"""An editing workload for speculative decoding: each prompt holds a piece of a Python
standard-library source file (text no one here wrote) and asks for it back with one name
changed, so a good answer is mostly a copy of the prompt — what n-gram and suffix drafting
exploit, as code-editing assistants' requests do.

Prompts are plain completions (no chat template), so any model and tokenizer can run them.
"""
from __future__ import annotations

import keyword
import os
import re
from collections import Counter
from typing import Any

_INSTRUCTION = ("Rewrite the following Python code with every `{old}` renamed to `{new}`. "
                "Change nothing else and output the whole code.\n\n")


def stdlib_sources(min_chars: int = 4000) -> list[str]:
    """Paths of the standard library's top-level modules of at least min_chars, sorted."""
    root = os.path.dirname(os.__file__)
    paths = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.endswith(".py") and os.path.isfile(path) and os.path.getsize(path) >= min_chars:
            paths.append(path)
    return paths


def _piece(text: str, tokenizer: Any, max_tokens: int) -> str:
    """The longest run of whole lines from the top of `text` within max_tokens tokens."""
    lines = text.splitlines(keepends=True)
    # A token is at least one character: no more lines than max_tokens * 8 characters hold
    # need be tried (and the tokenizer never sees a whole large file).
    chars = hi = 0
    while hi < len(lines) and chars <= max_tokens * 8:
        chars += len(lines[hi])
        hi += 1
    lo = 1
    while lo < hi:   # binary search on the line count
        mid = (lo + hi + 1) // 2
        if len(tokenizer.encode("".join(lines[:mid]), add_special_tokens=False)) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    return "".join(lines[:lo])


def _rename_target(code: str) -> tuple[str, str]:
    """A name defined in the code (a function, class or assigned name) and its new name."""
    for pattern in (r"^def (\w+)", r"^class (\w+)", r"^(\w+) = ", r"^\s+def (\w+)"):
        match = re.search(pattern, code, re.M)
        if match:
            old = match.group(1)
            return old, old + "_renamed"
    # no definition in the piece (a long docstring): its most frequent longer word
    words = Counter(w for w in re.findall(r"\b[A-Za-z_]\w{3,}\b", code)
                    if not keyword.iskeyword(w))
    old = words.most_common(1)[0][0] if words else "the"
    return old, old + "_renamed"


def editing_prompts(tokenizer: Any, num: int, code_tokens: int, start: int = 0) -> list[str]:
    """`num` prompts, each a different file's first ~code_tokens tokens of whole lines
    (files in sorted order from index `start`, wrapping around 40 lines further in)."""
    paths = stdlib_sources()
    if not paths:
        raise RuntimeError("no standard-library sources found for the editing workload")
    prompts = []
    for i in range(num):
        index = start + i
        with open(paths[index % len(paths)], encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines(keepends=True)
        # Past the last file, later laps start further into each file, so no two prompts
        # share a prefix (a prefix-cache hit would understate the prefill).
        skip = min(40 * (index // len(paths)), max(len(lines) - 40, 0))
        code = _piece("".join(lines[skip:]), tokenizer, code_tokens)
        old, new = _rename_target(code)
        prompts.append(_INSTRUCTION.format(old=old, new=new) + "```python\n" + code +
                       "```\n\nRewritten code:\n```python\n")
    return prompts
