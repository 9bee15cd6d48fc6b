"""Which runner a model gets (generate or pooling) and, for a pooling model, what it pools and
how: read from the architecture, the sentence-transformers files beside the weights
(modules.json, 1_Pooling/config.json, sentence_bert_config.json) and the --pooler-config
overrides. Torch-free (model info): the front end decides with it before the engine core
starts, and the worker builds the pooler from it.
"""
from __future__ import annotations

import json
import os
from typing import Any

from folio.pooling_params import PoolerConfig, PoolingModelInfo, PoolingType

# Encoders (bidirectional attention, absolute positions), as embedding models or classifiers.
ENCODER_EMBED_ARCHS = frozenset({"BertModel", "RobertaModel", "XLMRobertaModel"})
ENCODER_CLASSIFY_ARCHS = frozenset({"BertForSequenceClassification",
                                    "RobertaForSequenceClassification",
                                    "XLMRobertaForSequenceClassification"})
ENCODER_ARCHS = ENCODER_EMBED_ARCHS | ENCODER_CLASSIFY_ARCHS
_SEQ_CLS = "ForSequenceClassification"
_CAUSAL_LM = "ForCausalLM"

# sentence-transformers' pooling modes folio does not run.
_ST_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                         "pooling_mode_weightedmean_tokens")
# sentence-transformers' pooling modes (1_Pooling/config.json), in its order of precedence.
_ST_MODES = (("pooling_mode_cls_token", PoolingType.CLS),
             ("pooling_mode_mean_tokens", PoolingType.MEAN),
             ("pooling_mode_lasttoken", PoolingType.LAST))


def _read_json(path: str) -> Any | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _sentence_transformers(model_dir: str | None) -> dict:
    """The sentence-transformers files' settings: pooling type, normalize, max_seq_length
    (empty when the directory has no modules.json)."""
    if model_dir is None or not os.path.isdir(model_dir):
        return {}
    modules = _read_json(os.path.join(model_dir, "modules.json"))
    if not isinstance(modules, list):
        return {}
    found: dict[str, Any] = {"normalize": False}
    for module in modules:
        if not isinstance(module, dict):
            continue
        kind = str(module.get("type", ""))
        if kind.endswith("Pooling"):
            pooling = _read_json(os.path.join(model_dir, str(module.get("path", "")),
                                              "config.json")) or {}
            other = [key for key in _ST_UNSUPPORTED_MODES if pooling.get(key)]
            if other:
                raise ValueError(f"sentence-transformers pooling {other} is not supported "
                                 "(folio pools by CLS, MEAN or LAST token); set "
                                 "--pooler-config pooling_type to override")
            for key, pooling_type in _ST_MODES:
                if pooling.get(key):
                    found["pooling_type"] = pooling_type
                    break
        elif kind.endswith("Normalize"):
            found["normalize"] = True
        elif not kind.endswith("Transformer"):
            # a Dense projection or other head after pooling: embeddings would differ
            raise ValueError(f"sentence-transformers module {kind!r} is not supported "
                             "(folio runs Transformer, Pooling and Normalize)")
    bert_config = _read_json(os.path.join(model_dir, "sentence_bert_config.json")) or {}
    if isinstance(bert_config.get("max_seq_length"), int):
        found["max_seq_length"] = bert_config["max_seq_length"]
    return found


def _num_labels(hf_config: Any) -> tuple[int, tuple[str, ...]]:
    id2label = getattr(hf_config, "id2label", None) or {}
    labels = tuple(str(id2label[k]) for k in sorted(id2label, key=int)) if id2label else ()
    n = getattr(hf_config, "num_labels", None) or len(labels) or 2
    if len(labels) != n:
        labels = tuple(f"LABEL_{i}" for i in range(n))
    return int(n), labels


def resolve_runner(runner: str, convert: str, hf_config: Any, model_dir: str | None) -> str:
    """"generate" or "pooling" for this model ("auto": a *ForCausalLM architecture generates
    unless sentence-transformers files sit beside it; encoders and classifiers pool)."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if runner != "auto":
        return runner
    if convert not in ("auto", "none"):
        return "pooling"
    if any(a in ENCODER_ARCHS or a.endswith(_SEQ_CLS) for a in archs):
        return "pooling"
    if getattr(hf_config, "classifier_from_token", None):
        return "pooling"
    if _sentence_transformers(model_dir):
        return "pooling"   # e.g. Qwen3-Embedding: a causal LM in sentence-transformers layout
    return "generate"


def resolve_pooling_info(hf_config: Any, model_dir: str | None, convert: str = "auto",
                         pooler_config: PoolerConfig | None = None) -> PoolingModelInfo:
    """The pooling model this config describes, converted as `convert` asks ("embed": a
    decoder's last hidden state as an embedding; "classify": a decoder with a classifier on its
    last token — a *ForSequenceClassification checkpoint, or one made from the language-model
    head's rows of `classifier_from_token`; "reward": per-token classification). Raises
    ValueError for a model that cannot pool."""
    pooler_config = pooler_config or PoolerConfig()
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        raise ValueError("the model config names no architecture")
    arch = archs[0]
    st = _sentence_transformers(model_dir)
    from_token = tuple(getattr(hf_config, "classifier_from_token", None) or ())
    is_encoder = arch in ENCODER_ARCHS
    if is_encoder:
        kind = "embed" if arch in ENCODER_EMBED_ARCHS else "classify"
        if convert == "embed":
            kind = "embed"
        elif convert in ("classify", "reward") and kind != "classify":
            raise ValueError(f"convert={convert!r}: {arch} has no classifier head")
    elif arch.endswith(_SEQ_CLS) or from_token:
        kind = "classify"
    elif arch.endswith(_CAUSAL_LM):
        kind = "classify" if convert in ("classify", "reward") else "embed"
        if kind == "classify" and not from_token:
            raise ValueError(f"convert={convert!r}: {arch} has no classifier head; give "
                             "classifier_from_token in --hf-overrides, or use a "
                             "*ForSequenceClassification checkpoint")
    else:
        raise ValueError(f"architecture {arch} cannot be run by the pooling runner")
    if from_token and len(from_token) not in (1, 2):
        raise ValueError(f"classifier_from_token must name one or two tokens, got "
                         f"{list(from_token)}")
    default_type = PoolingType.CLS if is_encoder else PoolingType.LAST
    if kind == "embed" and "pooling_type" in st:
        default_type = st["pooling_type"]
    pooling_type = (PoolingType.parse(pooler_config.pooling_type)
                    if pooler_config.pooling_type else default_type)
    normalize = st.get("normalize", True) if kind == "embed" else False
    if pooler_config.normalize is not None:
        normalize = pooler_config.normalize
    num_labels, labels, activation = 0, (), "softmax"
    if kind == "classify":
        if from_token:
            num_labels = 1 if len(from_token) == 2 else len(from_token)
            labels = ("score",) if num_labels == 1 else from_token
        else:
            num_labels, labels = _num_labels(hf_config)
        multi = getattr(hf_config, "problem_type", None) == "multi_label_classification"
        activation = "sigmoid" if num_labels == 1 or multi else "softmax"
    matryoshka = getattr(hf_config, "matryoshka_dimensions", None)
    if matryoshka:
        dims: tuple[int, ...] | None = tuple(int(d) for d in matryoshka)
    elif getattr(hf_config, "is_matryoshka", False):
        dims = ()
    else:
        dims = None
    return PoolingModelInfo(
        kind=kind, architecture=arch, pooling_type=pooling_type, is_causal=not is_encoder,
        normalize=normalize,
        use_activation=True if pooler_config.use_activation is None
        else pooler_config.use_activation,
        num_labels=num_labels, activation=activation, labels=labels,
        classifier_from_token=from_token, max_seq_length=st.get("max_seq_length"),
        matryoshka_dimensions=dims, hidden_size=int(getattr(hf_config, "hidden_size", 0) or 0))


def token_ids_of(tokenizer: Any, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """The vocabulary ids of classifier_from_token's tokens (each must be one token)."""
    ids = []
    for token in tokens:
        found = tokenizer.convert_tokens_to_ids(token)
        unk = getattr(tokenizer, "unk_token_id", None)
        if not isinstance(found, int) or found < 0 or (found == unk and token != tokenizer.unk_token):
            encoded = tokenizer.encode(token, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(f"classifier_from_token: {token!r} is not one token of the "
                                 f"model's vocabulary")
            found = encoded[0]
        ids.append(int(found))
    return tuple(ids)
