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


def _help(capsys, *argv: str) -> str:
    from folio.entrypoints.cli import main
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping


def test_serve_help_shows_defaults(capsys):
    text = _help(capsys, "serve")
    assert "(default: 127.0.0.1)" in text
    assert "(default: 8000)" in text
    for default in ("(default: auto)",          # --dtype, --device, backend, --generation-config
                    "(default: 16)",            # --block-size
                    "(default: fcfs)",          # --scheduling-policy
                    "(default: True)",          # --enable-prefix-caching
                    "(default: 33554432)"):     # --max-request-body-bytes
        assert default in text, default
    # A default spelled out in words is not followed by argparse's own.
    assert "(default: the model's) (default" not in text
    assert "CPU) (default: None)" not in text


def test_serve_help_never_prints_the_api_key(capsys, monkeypatch):
    monkeypatch.setenv("FOLIO_API_KEY", "sekrit-key-123")
    assert "sekrit-key-123" not in _help(capsys, "serve")


@pytest.mark.parametrize("command", [["serve"], ["chat"], ["bench", "throughput"],
                                     ["bench", "latency"], ["bench", "serve"]])
def test_every_flag_has_help_and_a_default_shown(command):
    from folio.entrypoints.cli import build_parser
    parser = build_parser()
    for name in command:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) \
                or action.help == argparse.SUPPRESS:
            continue
        flag = "/".join(action.option_strings) or action.dest
        assert action.help, f"{' '.join(command)} {flag} has no help"
        assert "default" in action.help.lower() or "%(default)" in (
            parser._get_formatter()._get_help_string(action) or ""), flag
    assert text.count("(default: ") >= 10


def test_pooling_flags_reach_the_model_config():
    config = _config("--runner", "pooling", "--convert", "embed",
                     "--pooler-config", '{"pooling_type": "mean", "normalize": false}',
                     "--hf-overrides", '{"is_matryoshka": true}', "--max-pooling-inputs", "16")
    assert (config.model.runner, config.model.convert) == ("pooling", "embed")
    assert config.model.pooler_config == {"pooling_type": "mean", "normalize": False}
    assert config.model.hf_overrides == {"is_matryoshka": True}
    assert config.limits.max_pooling_inputs == 16
    defaults = _config()
    assert (defaults.model.runner, defaults.model.convert, defaults.model.task) == \
        ("auto", "auto", None)
    assert defaults.limits.max_pooling_inputs == 2048


def test_legacy_task_sets_runner_and_convert():
    config = _config("--task", "embedding")
    assert (config.model.runner, config.model.convert) == ("pooling", "embed")


@pytest.mark.parametrize("argv, message", [
    (["--pooler-config", "{not json"], "--pooler-config: not valid JSON"),
    (["--pooler-config", '["MEAN"]'], "--pooler-config: must be a JSON object"),
    (["--pooler-config", '{"pooling": "MEAN"}'], "unknown fields ['pooling']"),
    (["--hf-overrides", "7"], "--hf-overrides: must be a JSON object"),
    (["--runner", "embed"], "invalid choice"),
    (["--task", "generation"], "invalid choice"),
])
def test_bad_pooling_flags_are_argparse_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        _config(*argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_max_pooling_inputs_must_be_positive():
    with pytest.raises(ValueError, match="max_pooling_inputs"):
        _config("--max-pooling-inputs", "0")


def test_log_level_is_taken_after_the_server_command_too():
    from folio.entrypoints.cli import build_parser
    parser = build_parser()
    assert parser.parse_args(["serve", "m", "--log-level", "debug"]).log_level == "debug"
    assert parser.parse_args(["--log-level", "info", "serve", "m"]).log_level == "info"
    assert parser.parse_args(["serve", "m"]).log_level is None
    assert parser.parse_args(["router", "--prefill", "http://a:1", "--decode", "http://b:2",
                              "--log-level", "DEBUG"]).log_level == "DEBUG"


def test_a_setting_the_engine_core_refuses_is_a_usage_error() -> None:
    """A bad setting found only where the model is read, in the engine-core process (mtp on
    a model without MTP layers), ends `folio serve` as argparse's errors do: exit code 2 and
    one `folio: error:` line naming the field, no traceback."""
    import os
    import subprocess
    import sys

    from server_utils import free_port
    proc = subprocess.run(
        [sys.executable, "-m", "folio.entrypoints.cli", "serve", "--port", str(free_port()),
         "--speculative-config", '{"method": "mtp"}'],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "folio: error: speculative_config.method mtp" in proc.stderr
    assert "Traceback" not in proc.stderr
