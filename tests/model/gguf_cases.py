"""What the GGUF end-to-end tests share (tests/model/test_gguf_packed.py, test_gguf_kquants.py):
a model's prefill logits outside the engine, the perplexity text, the chat prompts."""
from __future__ import annotations

import torch

# Chat prompts of the greedy comparisons through the engine.
CHAT_PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.", "List three prime numbers.",
    "Who wrote Romeo and Juliet?", "What is 12 times 7?", "Give me a synonym for happy.",
    "Describe a cat to a child.", "What is the boiling point of water?",
    "Name a planet in our solar system.", "How do I make a cup of tea?",
    "Translate 'good morning' into Spanish.", "What color is the sky on a clear day?",
    "Tell me a fun fact about octopuses.", "Why do leaves change color in autumn?"]


def load_pair(path: str, max_model_len: int = 512):
    """The model of a GGUF file (folio's ModelSource or a path) loaded twice on the CPU in
    float32: (packed: quantization "gguf", float: quantization "none", its dequantized
    weights)."""
    from folio.model.discovery import ModelSource, load_hf_config, resolve_model_source
    from folio.model.loader import load_model
    source = path if isinstance(path, ModelSource) else resolve_model_source(path)
    hf_config, _ = load_hf_config(source)
    cpu = torch.device("cpu")
    packed, _ = load_model(source, hf_config, torch.float32, cpu, max_model_len,
                           quantization="gguf")
    plain, _ = load_model(source, hf_config, torch.float32, cpu, max_model_len,
                          quantization="none")
    return packed, plain


def prefill_logits(model, ids: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Logits [T, vocab] of one prompt through `model` (a DecoderLM) and its own paged KV
    cache: one prefill, or (`chunk`) one step per `chunk` tokens, each attending to the cache
    the steps before filled (chunked prefill). The packed CPU matmuls take a prefill's many
    rows through float32 tiles of W and torch's GEMM, bit for bit the float path's; a few rows
    at a time (< 33) go through their own register-blocked kernels, as decoding does."""
    from folio.model.attention import AttentionMetadata
    T, bs = len(ids), 16
    chunk = chunk or T
    blocks = -(-T // bs)
    kv = [torch.zeros(2, blocks, bs, model.spec.num_kv_heads, model.spec.head_dim)
          for _ in model.layers]
    out = []
    with torch.inference_mode():
        for start in range(0, T, chunk):
            end = min(start + chunk, T)
            meta = AttentionMetadata(slot_mapping=torch.arange(start, end),
                                     query_start_loc=[0, end - start], seq_lens=[end],
                                     num_computed_tokens=[start],
                                     block_tables=torch.arange(blocks)[None], block_size=bs)
            positions = torch.arange(start, end)
            out.append(model.compute_logits(model(ids[start:end], positions, kv, meta)))
    return torch.cat(out)


def license_ids(n: int = 384) -> torch.Tensor:
    """The first `n` tokens (SmolLM2's tokenizer) of CPython's LICENSE.txt, a text that ships
    with every Python."""
    import os
    import sysconfig

    from transformers import AutoTokenizer

    from folio.model.default_model import default_model_path
    path = os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    ids = torch.tensor(tokenizer(text)["input_ids"][:n])
    assert len(ids) == n
    return ids


def perplexity(model, ids: torch.Tensor, chunk: int | None = None) -> float:
    """exp(mean next-token cross entropy) of `ids` under `model` (`chunk`: see
    prefill_logits)."""
    logits = prefill_logits(model, ids, chunk)[:-1].double()
    return float(torch.exp(torch.nn.functional.cross_entropy(logits, ids[1:])))
