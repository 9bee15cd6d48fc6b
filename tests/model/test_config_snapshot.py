"""The config snapshot (folio/model/config_snapshot.py): what folio derives from it equals what
it derives from transformers' own config, for every family; a warm read imports no
transformers; the cache key follows the file and the library."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
import transformers
from transformers import AutoConfig

from folio.model.config_snapshot import ConfigSnapshot, cached_config, snapshot_key
from folio.model.discovery import ModelSource, load_hf_config
from folio.model.families import arch_spec_from_hf_config
from folio.model.loader import resolve_dtype
from folio.model.pooling_info import resolve_pooling_info, resolve_runner
from folio.pooling_params import PoolerConfig
from tests.model_utils import _COMMON, TINY_ARCHS

# Encoders and a sequence classifier beside the decoders of TINY_ARCHS.
_EXTRA = {
    "bert": ("BertConfig", "BertModel", dict(hidden_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=128)),
    "xlm_roberta": ("XLMRobertaConfig", "XLMRobertaForSequenceClassification",
                    dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128, id2label={0: "no", 1: "yes", 2: "maybe"})),
    "qwen3_cls": ("Qwen3Config", "Qwen3ForSequenceClassification",
                  dict(_COMMON, head_dim=32, num_labels=1)),
}


def _configs() -> dict[str, tuple[str, str, dict]]:
    out = {name: (a.config_cls, a.architecture, dict(_COMMON, **dict(a.overrides)))
           for name, a in TINY_ARCHS.items()}
    out.update(_EXTRA)
    return out


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FOLIO_CACHE_DIR", str(tmp_path / "cache"))


def _save(tmp_path, name: str) -> str:
    cls, arch, kwargs = _configs()[name]
    config = getattr(transformers, cls)(**kwargs)
    config.architectures = [arch]
    path = str(tmp_path / name)
    config.save_pretrained(path)
    return path


@pytest.mark.parametrize("name", sorted(_configs()))
def test_what_folio_derives_equals_transformers(tmp_path, name):
    path = _save(tmp_path, name)
    reference = AutoConfig.from_pretrained(path)
    snap, _ = load_hf_config(ModelSource("hf_dir", path))
    again, _ = load_hf_config(ModelSource("hf_dir", path))   # read back from the cache
    assert isinstance(snap, ConfigSnapshot) and again == snap
    runner = resolve_runner("auto", "auto", reference, path)
    assert resolve_runner("auto", "auto", again, path) == runner
    if runner == "pooling":
        assert (resolve_pooling_info(again, path, "auto", PoolerConfig())
                == resolve_pooling_info(reference, path, "auto", PoolerConfig()))
    assert arch_spec_from_hf_config(again) == arch_spec_from_hf_config(reference)
    for device in ("cpu", "cuda"):
        assert (resolve_dtype("auto", again, torch.device(device))
                == resolve_dtype("auto", reference, torch.device(device)))
    for name_read in ("max_position_embeddings", "eos_token_id", "vocab_size", "model_type",
                      "architectures", "tie_word_embeddings"):
        assert getattr(again, name_read) == getattr(reference, name_read)


def test_aliases_read_and_write_through_the_attribute_map(tmp_path):
    snap, _ = load_hf_config(ModelSource("hf_dir", _save(tmp_path, "mixtral")))
    assert snap.num_experts == snap.num_local_experts == 4
    snap.num_experts = 6            # an hf_overrides entry by its alias
    assert snap.num_local_experts == 6
    with pytest.raises(AttributeError):
        snap.no_such_setting
    assert getattr(snap, "no_such_setting", 7) == 7


def test_snapshot_pickles_for_the_worker_process(tmp_path):
    snap, _ = load_hf_config(ModelSource("hf_dir", _save(tmp_path, "deepseek_v2")))
    copy = pickle.loads(pickle.dumps(snap))
    assert copy == snap and copy.kv_lora_rank == 32
    assert arch_spec_from_hf_config(copy) == arch_spec_from_hf_config(snap)


def test_the_key_follows_the_file_and_the_library(tmp_path, monkeypatch):
    path = _save(tmp_path, "qwen3")
    first, _ = load_hf_config(ModelSource("hf_dir", path))
    with open(os.path.join(path, "config.json")) as f:
        data = json.load(f)
    data["vocab_size"] = 1000
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(data, f)
    second, _ = load_hf_config(ModelSource("hf_dir", path))
    assert (first.vocab_size, second.vocab_size) == (_COMMON["vocab_size"], 1000)
    key = snapshot_key(["x"])
    monkeypatch.setattr("folio.model.config_snapshot._transformers_version", lambda: "0.0")
    assert snapshot_key(["x"]) != key


def test_a_broken_config_is_a_value_error_not_a_cached_one(tmp_path):
    path = tmp_path / "broken"
    path.mkdir()
    (path / "config.json").write_text("{not json")
    for _ in range(2):
        with pytest.raises(ValueError, match="could not read the model config"):
            load_hf_config(ModelSource("hf_dir", str(path)))


def test_an_unwritable_cache_still_gives_the_config(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("FOLIO_CACHE_DIR", str(blocker))   # a file: no directory under it
    calls = []
    snap = cached_config(["m"], lambda: calls.append(1) or AutoConfig.for_model("llama"))
    again = cached_config(["m"], lambda: calls.append(1) or AutoConfig.for_model("llama"))
    assert snap == again and calls == [1, 1]


def test_a_warm_read_imports_no_transformers(tmp_path):
    path = _save(tmp_path, "qwen3")
    load_hf_config(ModelSource("hf_dir", path))   # writes the snapshot
    code = ("import sys; from folio.model.discovery import ModelSource, load_hf_config; "
            f"c, _ = load_hf_config(ModelSource('hf_dir', {path!r})); "
            "print(c.head_dim, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ), check=True).stdout.split()
    assert out == ["32", "False"]
