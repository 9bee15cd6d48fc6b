"""Real text no one here wrote, for the pooling benchmarks and parity checks: docstrings of
Python's standard library, in a fixed order, so every run and every peer sees the same texts.
Their lengths are naturally mixed (a one-line summary to a page of reference)."""
from __future__ import annotations

import importlib
import inspect

# Modules whose docstrings are plain English prose; fixed, so the list does not depend on
# what else is installed.
_MODULES = ("os", "json", "collections", "re", "inspect", "argparse", "pathlib", "typing",
            "functools", "itertools", "subprocess", "logging", "email", "http.client",
            "urllib.parse", "asyncio", "threading", "socket", "datetime", "decimal",
            "fractions", "statistics", "string", "textwrap", "difflib", "heapq", "bisect",
            "shutil", "tempfile", "zipfile", "tarfile", "csv", "configparser", "hashlib",
            "hmac", "secrets", "uuid", "base64", "binascii", "struct", "codecs", "locale",
            "calendar", "time", "sched", "queue", "contextlib", "abc", "dataclasses", "enum",
            "numbers", "math", "random", "operator", "copy", "pickle", "shelve", "sqlite3",
            "zlib", "gzip", "bz2", "lzma", "glob", "fnmatch", "filecmp", "io", "traceback",
            "warnings", "weakref", "types", "pprint", "reprlib", "ast", "dis", "tokenize",
            "unittest", "doctest", "pdb", "timeit", "trace", "gc", "site", "sysconfig")
# Longer docstrings are cut here: a benchmark measures the model, not a 20-page class manual.
MAX_CHARS = 2000


def stdlib_texts(count: int, *, min_chars: int = 8) -> list[str]:
    """The first `count` distinct docstrings (whitespace-normalized, at most MAX_CHARS) of
    the modules above and their public members, in a fixed order. Raises ValueError if the
    standard library has fewer."""
    texts: list[str] = []
    seen: set[str] = set()
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for _, obj in [(name, module)] + sorted(inspect.getmembers(module),
                                                key=lambda kv: kv[0]):
            doc = inspect.getdoc(obj)
            if not doc:
                continue
            text = " ".join(doc.split())[:MAX_CHARS]
            if len(text) < min_chars or text in seen:
                continue
            seen.add(text)
            texts.append(text)
            if len(texts) == count:
                return texts
    raise ValueError(f"the standard library has only {len(texts)} docstrings, {count} asked for")
