"""`folio serve` flags reach the engine config: the structured-output backend and the
reasoning parser (which makes the engine apply a JSON constraint only after the reasoning)."""
from __future__ import annotations

import argparse

import pytest

from folio.entrypoints.openai.cli_args import add_serve_args, build_engine_config


def _config(*argv: str):
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return build_engine_config(parser.parse_args(list(argv)))


def test_defaults():
    config = _config()
    assert config.structured_outputs.backend == "auto"
    assert config.structured_outputs.reasoning_parser is None


def test_backend_and_reasoning_parser_reach_the_engine():
    config = _config("--structured-outputs-config.backend", "guidance",
                     "--reasoning-parser", "qwen3")
    assert config.structured_outputs.backend == "guidance"
    assert config.structured_outputs.reasoning_parser == "qwen3"


def test_unknown_backend_is_refused():
    with pytest.raises(SystemExit):
        _config("--structured-outputs-config.backend", "outlines")
