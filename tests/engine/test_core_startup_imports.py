"""The engine core's process reads the model's config from its snapshot and loads no
tokenizer: on a warm start it imports no transformers (seconds of a GPU server's restart;
issue 21, item 7)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from folio.model.default_model import default_model_path

_CODE = """
import sys
from folio.config import EngineConfig, ModelConfig
from folio.engine.frontend import load_model_info
config = EngineConfig(model=ModelConfig(model={model!r}, max_model_len=512))
info = load_model_info(config, with_tokenizer={with_tokenizer})
print(info.tokenizer is None, info.max_model_len, 'transformers' in sys.modules)
"""


def _run(model: str, with_tokenizer: bool) -> list[str]:
    code = _CODE.format(model=model, with_tokenizer=with_tokenizer)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env=dict(os.environ)).stdout.split()


def test_engine_core_model_info_imports_no_transformers():
    try:
        model = default_model_path()
    except Exception as exc:  # pragma: no cover - the default model is set up by `make setup`
        pytest.skip(f"default model not installed: {exc}")
    _run(model, True)   # a front end's start: writes the config snapshot if it was missing
    assert _run(model, False) == ["True", "512", "False"]
    assert _run(model, True) == ["False", "512", "True"]
