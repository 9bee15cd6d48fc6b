"""Pooling on a CUDA GPU (issue 19): LLM.embed of a tiny random BERT in the sentence-transformers
layout (mean pooling, then normalize) against transformers' BertModel on the same weights, over
texts of mixed lengths. bfloat16 runs the flat batch through torch's variable-length flash
attention, float32 through the grouped SDPA path; a small token budget spreads the texts over
many steps (async scheduling: each step's inputs are copied while the one before runs), a large
one takes them in one step. Skipped without a GPU.

Self-contained (no packages with weights on the GPU machine): the model and a word-level
tokenizer are built here.
"""
from __future__ import annotations

import json
import os
import random

import pytest
import torch
from word_tokenizer import save_word_tokenizer
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB = 1024
DEVICE = "cuda"


def _build(path: str) -> str:
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=512,
                        max_position_embeddings=512, type_vocab_size=2)
    BertModel(config, add_pooling_layer=False).eval().save_pretrained(path)
    save_word_tokenizer(path, VOCAB, {"unk_token": "[UNK]", "pad_token": "[PAD]"},
                        model_max_length=512)
    # sentence-transformers' layout, as all-MiniLM-L6-v2 ships it: mean pooling, normalize
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize"}]
    os.makedirs(os.path.join(path, "1_Pooling"))
    os.makedirs(os.path.join(path, "2_Normalize"))
    for name, content in {"modules.json": modules,
                          "sentence_bert_config.json": {"max_seq_length": 512},
                          "1_Pooling/config.json": {"word_embedding_dimension": 256,
                                                    "pooling_mode_mean_tokens": True}}.items():
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            json.dump(content, f)
    return path


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> str:
    return _build(str(tmp_path_factory.mktemp("bert")))


def _texts(n: int) -> list[str]:
    rng = random.Random(0)
    lengths = [rng.choice([1, 3, 8, 17, 40, 97, 200, 511]) for _ in range(n)]
    return [" ".join(f"w{rng.randrange(2, VOCAB)}" for _ in range(k)) for k in lengths]


def _reference(model_dir: str, ids: list[list[int]]) -> torch.Tensor:
    """transformers' BertModel in float32, one unpadded input at a time, mean-pooled and
    normalized."""
    from transformers import BertModel
    model = BertModel.from_pretrained(model_dir, add_pooling_layer=False,
                                      dtype=torch.float32).to(DEVICE).eval()
    rows = []
    with torch.no_grad():
        for x in ids:
            hidden = model(torch.tensor([x], device=DEVICE)).last_hidden_state[0]
            rows.append(F.normalize(hidden.mean(0), dim=-1))
    return torch.stack(rows).cpu()


@pytest.mark.parametrize("dtype,budget,bar", [("bfloat16", 16384, 0.999),
                                               ("bfloat16", 512, 0.999),
                                               ("float32", 512, 0.99999)])
def test_embed_matches_transformers(bert_dir: str, dtype: str, budget: int, bar: float) -> None:
    from folio import LLM
    texts = _texts(60)
    llm = LLM(bert_dir, dtype=dtype, device=DEVICE, max_num_batched_tokens=budget,
              max_num_seqs=256)
    try:
        outputs = llm.embed(texts, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    ids = [o.prompt_token_ids for o in outputs]
    assert [len(x) for x in ids] == [len(t.split()) for t in texts]
    got = torch.tensor([o.outputs.embedding for o in outputs])
    want = _reference(bert_dir, ids)
    cosine = (got * want).sum(-1) / got.norm(dim=-1) / want.norm(dim=-1)
    assert float(cosine.min()) >= bar, (dtype, budget, cosine.min(), int(cosine.argmin()))
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(texts)), atol=1e-3)
