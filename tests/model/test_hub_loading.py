"""Loading by hub id goes through huggingface_hub.snapshot_download. No network here, so the
test fills a hub cache folder by hand (the layout huggingface_hub itself writes) and runs in
offline mode: the same code path a networked user takes, minus the download."""
from __future__ import annotations

import os
import shutil

import huggingface_hub.constants as hub_constants
import pytest

from folio import LLM, SamplingParams


def _fill_hub_cache(cache: str, repo_id: str, model_dir: str) -> None:
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(revision)
    shutil.copytree(model_dir, os.path.join(repo, "snapshots", revision))


def test_load_by_hub_id(tmp_path, monkeypatch, tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    cache = str(tmp_path / "hub")
    _fill_hub_cache(cache, "folio-test/tiny-llama", model_dir)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", cache)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    by_id = LLM("folio-test/tiny-llama", dtype="float32", max_model_len=128, num_gpu_blocks_override=16)
    assert by_id.llm_engine.model_source.path.startswith(cache)
    by_path = LLM(model_dir, dtype="float32", max_model_len=128, num_gpu_blocks_override=16)
    a = by_id.generate(["Hello hub"], params, use_tqdm=False)[0].outputs[0].token_ids
    b = by_path.generate(["Hello hub"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b and len(a) == 6


def test_unknown_hub_id_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="folio-test/no-such-model"):
        LLM("folio-test/no-such-model")
