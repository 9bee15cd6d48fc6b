"""The names users import from `folio` (vLLM's public API), and `import folio` staying light."""
from __future__ import annotations

import subprocess
import sys

import folio


def test_public_names_are_exported():
    from folio import (CompletionOutput, Logprob, RequestOutput, RequestOutputKind,  # noqa: F401
                       SamplingParams, StructuredOutputsParams)
    from folio.structured_output.params import StructuredOutputsParams as Defined
    assert StructuredOutputsParams is Defined
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    assert params.structured_outputs.choice == ["a", "b"]
    for name in folio.__all__:
        assert name in dir(folio), name


def test_unknown_name_raises_attribute_error():
    try:
        folio.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("folio.NoSuchThing did not raise")


def test_import_folio_leaves_torch_out():
    code = ("import sys, folio\n"
            "from folio import SamplingParams, StructuredOutputsParams, PromptType\n"
            "heavy = [m for m in ('torch', 'transformers', 'zmq', 'xgrammar', 'llguidance')"
            " if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_lazy_heavy_names_resolve():
    code = ("import folio\n"
            "from folio.engine.async_llm import AsyncLLM\n"
            "from folio.engine.llm_engine import LLMEngine\n"
            "from folio.entrypoints.llm import LLM\n"
            "assert folio.AsyncLLM is AsyncLLM and folio.LLMEngine is LLMEngine and folio.LLM is LLM\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
