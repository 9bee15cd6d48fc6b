"""The API process runs no torch code of folio's: the server's modules, model discovery, the
tokenizer, request preparation. Each check runs in a fresh interpreter.

Every `import torch` / `import triton` is recorded with the module that ran it. transformers
(5.x) imports torch on its own as soon as it builds a config or a tokenizer
(configuration_utils -> modeling_rope_utils, whenever torch is installed), so the model-info
check accepts torch loaded by transformers, and by nothing else; if transformers stops doing
it, torch is simply absent.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

# Records who imports torch or triton: the module running each import statement
# (builtins.__import__), and who loads each first, by any route (a meta-path finder that only
# watches).
_PROBE = r'''
import builtins, json, sys

_WATCHED = ("torch", "triton")
importers = set()
first_loaded_by = {}
_probe_globals = globals()


def _caller(frame):
    while frame is not None and (frame.f_globals is _probe_globals or frame.f_globals.get(
            "__name__", "").startswith(("importlib", "_frozen_importlib"))):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "?") if frame is not None else "?"


_original_import = builtins.__import__


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and name.split(".")[0] in _WATCHED:
        importers.add((globals or {}).get("__name__", "?"))
    return _original_import(name, globals, locals, fromlist, level)


class _Watcher:
    def find_spec(self, name, path=None, target=None):
        if name in _WATCHED and name not in first_loaded_by:
            first_loaded_by[name] = _caller(sys._getframe(1))
        return None


builtins.__import__ = _import
sys.meta_path.insert(0, _Watcher())
result = {}
'''

_REPORT = r'''
# folio modules that need torch (the weights, the device, the kernels).
_TORCH_SIDE = ("folio.worker", "folio.executor", "folio.model.loader", "folio.model.decoder",
               "folio.model.layers", "folio.model.attention", "folio.model.kernels",
               "folio.model.gguf_loader", "folio.model.host_copy",
               "folio.structured_output.backend", "folio.structured_output.masking")
result.update(
    torch="torch" in sys.modules, triton="triton" in sys.modules,
    importers=sorted(importers), first_loaded_by=first_loaded_by,
    torch_side=sorted(m for m in sys.modules if m.startswith(_TORCH_SIDE)))
print("RESULT " + json.dumps(result))
'''


def _probe(code: str) -> dict:
    script = _PROBE + textwrap.dedent(code) + _REPORT
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_importing_the_server_loads_no_torch():
    result = _probe("""
        import folio.entrypoints.openai.api_server
        import folio.entrypoints.cli
    """)
    assert result["importers"] == [] and result["first_loaded_by"] == {}, result
    assert not result["torch"] and not result["triton"]
    assert result["torch_side"] == []


@pytest.fixture(scope="module")
def default_model_converted() -> str:
    """The front end's normal start: the default GGUF already converted (a first start converts
    it, the one place the API process imports torch)."""
    from folio.model.default_model import DefaultModelNotInstalled, default_model_path
    try:
        return default_model_path()
    except DefaultModelNotInstalled as exc:
        pytest.fail(f"the default model is part of the test setup (make test installs it): {exc}")


def test_front_end_model_info_runs_no_torch_code_of_folio(default_model_converted):
    result = _probe("""
        from folio.config import EngineConfig
        from folio.engine.chat import apply_chat_template
        from folio.engine.frontend import RequestPreparer, default_sampling_params, load_model_info
        from folio.engine.output_processor import OutputProcessor
        from folio.sampling_params import SamplingParams

        config = EngineConfig()
        info = load_model_info(config)
        preparer = RequestPreparer(info, config.structured_outputs.backend, config.limits)
        prompt = apply_chat_template(info.tokenizer, [{"role": "user", "content": "Hi"}])
        prepared = preparer.prepare("r", prompt, SamplingParams(max_tokens=4))
        OutputProcessor(info.tokenizer)
        default_sampling_params(info)
        result.update(max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                      max_num_seqs=config.scheduler.max_num_seqs,
                      max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                      prompt_tokens=len(prepared.core_requests[0].prompt_token_ids))
    """)
    folio_importers = [m for m in result["importers"] if m == "folio" or m.startswith("folio.")]
    assert folio_importers == [], result
    assert result["first_loaded_by"].get("torch", "transformers").startswith("transformers."), result
    assert not result["triton"] and result["torch_side"] == [], result
    # The model-dependent defaults as before; the device-dependent one (max_num_seqs) waits for
    # the engine core with device "auto" (finding out needs torch).
    assert (result["max_model_len"], result["vocab_size"]) == (8192, 49152)
    assert result["max_num_batched_tokens"] == 2048 and result["max_num_seqs"] is None
    assert result["prompt_tokens"] > 0
