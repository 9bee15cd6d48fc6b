"""Fixtures shared by the structured-output tests: the default model's tokenizer and vocab."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from folio.model.default_model import default_model_path


@pytest.fixture(scope="session")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="session")
def vocab_size() -> int:
    config = json.loads((Path(default_model_path()) / "config.json").read_text())
    return int(config["vocab_size"])
