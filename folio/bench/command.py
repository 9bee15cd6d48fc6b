"""The shape every `folio bench X` entry point shares: its flags, a run, and a bad setting
reported as `folio bench X: error: ...` with exit status 2 (argparse's convention)."""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable


def bench_main(argv: list[str] | None, prog: str, description: str,
               add_cli_args: Callable[[argparse.ArgumentParser], None],
               run: Callable[[argparse.Namespace], Any]) -> int:
    from folio.entrypoints.help_format import FolioHelpFormatter
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=FolioHelpFormatter)
    add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        run(args)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    return 0
