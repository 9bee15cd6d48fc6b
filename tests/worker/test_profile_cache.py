"""The KV profiling result kept across restarts (folio/worker/profile_cache.py): a start reuses
it only when everything the profiled pass depends on is the same."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from folio.config import EngineConfig
from folio.model.kernel_config import KernelConfig
from folio.worker import profile_cache


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FOLIO_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (model / "model.safetensors").write_bytes(b"\0" * 128)
    return model


def _key(model, config: EngineConfig | None = None, kernels: KernelConfig | None = None,
         gpu: str = "NVIDIA H200 sm90") -> str:
    return profile_cache.profile_key(config or EngineConfig(), kernels or KernelConfig(),
                                     str(model), gpu)


def test_round_trip_and_missing(model_dir) -> None:
    key = _key(model_dir)
    assert profile_cache.load_activation_bytes(key) is None
    profile_cache.store_activation_bytes(key, 123_456_789)
    assert profile_cache.load_activation_bytes(key) == 123_456_789
    assert _key(model_dir) == key            # the same start: the same key


def test_every_input_changes_the_key(model_dir) -> None:
    key = _key(model_dir)
    config = EngineConfig()
    bigger = dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, max_num_batched_tokens=4096))
    assert _key(model_dir, config=bigger) != key
    assert _key(model_dir, kernels=KernelConfig(gemv="0")) != key
    assert _key(model_dir, gpu="NVIDIA H100 sm90") != key
    (model_dir / "config.json").write_text(json.dumps({"hidden_size": 128}))
    assert _key(model_dir) != key
    changed = _key(model_dir)
    (model_dir / "model.safetensors").write_bytes(b"\0" * 256)    # weights replaced
    assert _key(model_dir) != changed


def test_unreadable_entries_are_ignored(model_dir) -> None:
    key = _key(model_dir)
    profile_cache.store_activation_bytes(key, 5)
    path = profile_cache._path(key)
    for bad in ("{not json", json.dumps({"activation_bytes": -1}),
                json.dumps({"activation_bytes": "5"}), json.dumps([])):
        with open(path, "w") as f:
            f.write(bad)
        assert profile_cache.load_activation_bytes(key) is None
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.endswith(".tmp")]
