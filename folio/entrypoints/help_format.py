"""The help formatter of every `folio` command: each flag's default is shown.

Kept in its own module (argparse, re only) so `folio --help` and the benchmarks' parsers
import nothing heavy.
"""
from __future__ import annotations

import argparse
import re

__all__ = ["FolioHelpFormatter"]

# A help text that already says what the default is, in words: "(default: the model's)",
# "(default 256 on CUDA, ...)", "...; default: the embedded ...". Such flags have a default of
# None that the engine resolves later, so "(default: None)" would only mislead.
_STATES_DEFAULT = re.compile(r"\(default\b|\bdefault:", re.IGNORECASE)


class FolioHelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                         argparse.RawDescriptionHelpFormatter):
    """argparse's ArgumentDefaultsHelpFormatter, appending "(default: X)" to every flag's help,
    unless the help already states the default in words; keeps line breaks in descriptions.
    Never prints the value of a secret (an API key's default comes from the environment)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if _STATES_DEFAULT.search(text) or "api_key" in (action.dest or ""):
            return action.help
        return super()._get_help_string(action)
