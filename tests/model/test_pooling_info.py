"""Which runner a model gets and what a pooling model pools (model/pooling_info.py): the
architecture, sentence-transformers files, --convert / --task and --pooler-config."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from folio.config import ModelConfig
from folio.model.pooling_info import resolve_pooling_info, resolve_runner
from folio.pooling_params import PoolerConfig, PoolingType


def config(arch: str, **extra) -> SimpleNamespace:
    return SimpleNamespace(architectures=[arch], hidden_size=32, **extra)


def st_dir(tmp_path, pooling: dict, modules: list[str] | None = None) -> str:
    kinds = modules or ["Transformer", "Pooling", "Normalize"]
    entries = [{"idx": i, "name": str(i), "path": "1_Pooling" if k == "Pooling" else "",
                "type": f"sentence_transformers.models.{k}"} for i, k in enumerate(kinds)]
    (tmp_path / "modules.json").write_text(json.dumps(entries))
    os.makedirs(tmp_path / "1_Pooling", exist_ok=True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    return str(tmp_path)


def test_runner_by_architecture_and_files(tmp_path):
    assert resolve_runner("auto", "auto", config("LlamaForCausalLM"), None) == "generate"
    assert resolve_runner("auto", "auto", config("BertModel"), None) == "pooling"
    assert resolve_runner("auto", "auto", config("Qwen3ForSequenceClassification"),
                          None) == "pooling"
    st = st_dir(tmp_path, {"pooling_mode_lasttoken": True})
    assert resolve_runner("auto", "auto", config("Qwen3ForCausalLM"), st) == "pooling"
    assert resolve_runner("generate", "auto", config("BertModel"), None) == "generate"
    assert resolve_runner("auto", "embed", config("LlamaForCausalLM"), None) == "pooling"


def test_sentence_transformers_settings(tmp_path):
    st = st_dir(tmp_path, {"pooling_mode_mean_tokens": True})
    info = resolve_pooling_info(config("BertModel"), st)
    assert (info.kind, info.pooling_type, info.normalize, info.max_seq_length) == (
        "embed", PoolingType.MEAN, True, 128)
    assert not info.prefix_caching                  # an encoder
    overridden = resolve_pooling_info(config("BertModel"), st,
                                      pooler_config=PoolerConfig("CLS", False))
    assert overridden.pooling_type == PoolingType.CLS and not overridden.normalize


def test_unsupported_sentence_transformers_modules_are_refused(tmp_path):
    st = st_dir(tmp_path, {"pooling_mode_max_tokens": True})
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        resolve_pooling_info(config("BertModel"), st)
    dense = st_dir(tmp_path, {"pooling_mode_mean_tokens": True},
                   ["Transformer", "Pooling", "Dense", "Normalize"])
    with pytest.raises(ValueError, match="Dense"):
        resolve_pooling_info(config("BertModel"), dense)


def test_decoders_classifiers_and_rerankers():
    embed = resolve_pooling_info(config("Qwen3ForCausalLM"), None)
    assert (embed.kind, embed.pooling_type, embed.is_causal) == ("embed", PoolingType.LAST, True)
    assert embed.prefix_caching
    cls = resolve_pooling_info(config("Qwen3ForSequenceClassification", num_labels=1), None)
    assert (cls.kind, cls.num_labels, cls.activation) == ("classify", 1, "sigmoid")
    three = resolve_pooling_info(config("BertForSequenceClassification", num_labels=3,
                                        id2label={0: "a", 1: "b", 2: "c"}), None)
    assert three.labels == ("a", "b", "c") and three.activation == "softmax"
    assert "score" not in {t.value for t in three.tasks}   # three labels: no single score
    reranker = resolve_pooling_info(config("Qwen3ForCausalLM",
                                           classifier_from_token=["no", "yes"]), None)
    assert (reranker.kind, reranker.num_labels) == ("classify", 1)
    with pytest.raises(ValueError, match="no classifier head"):
        resolve_pooling_info(config("LlamaForCausalLM"), None, convert="classify")
    with pytest.raises(ValueError, match="cannot be run by the pooling runner"):
        resolve_pooling_info(config("WhisperForConditionalGeneration"), None)


def test_task_aliases_set_runner_and_convert():
    assert (ModelConfig(task="embed").runner, ModelConfig(task="embed").convert) == (
        "pooling", "embed")
    assert ModelConfig(task="score").convert == "auto"
    with pytest.raises(ValueError, match="^task"):
        ModelConfig(task="translate")
    with pytest.raises(ValueError, match="^pooler_config"):
        ModelConfig(pooler_config={"pooling_type": "max"})
