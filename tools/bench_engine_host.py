"""Host cost of the whole engine step, without the model's compute: a 1-layer, 64-wide
Qwen3-shaped model with random weights on the CPU, 256 requests ([100, 1024]-token prompts,
[100, 300] output tokens, T=1 sampling, detokenize off), stepped by LLM.generate under
cProfile. What is left is Python: scheduling, input building, sampling set-up, updates and
output processing — the work async scheduling must hide behind the GPU. Prints ms per step
and the top functions. CPU only."""
from __future__ import annotations

import cProfile
import os
import pstats
import random
import sys
import tempfile
import time

import torch

from folio import LLM, SamplingParams


def build_tiny_qwen3(path: str) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(vocab_size=4096, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=32, max_position_embeddings=4096)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(4096)}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "t0")),
                                   eos_token="t1")
    fast.save_pretrained(path)
    return path


num = int(sys.argv[1]) if len(sys.argv) > 1 else 256
with tempfile.TemporaryDirectory() as tmp:
    llm = LLM(build_tiny_qwen3(tmp), dtype="float32", max_model_len=2048, max_num_seqs=256,
              kv_cache_memory_bytes=1 << 30)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 4096) for _ in range(rng.randint(100, 1024))]}
               for _ in range(num)]
    params = [SamplingParams(temperature=1.0, max_tokens=rng.randint(100, 300), ignore_eos=True,
                             detokenize=False) for _ in range(num)]
    llm.generate(prompts[:16], params[:16], use_tqdm=False)
    core = llm.llm_engine.engine_core
    steps = [0]
    inner = core.step

    def counted():
        steps[0] += 1
        return inner()

    core.step = counted
    prof = cProfile.Profile()
    start = time.perf_counter()
    if os.environ.get("PROFILE", "1") == "1":
        prof.enable()
    llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    wall = time.perf_counter() - start
    print(f"{num} requests: {steps[0]} steps, {1e3 * wall / steps[0]:.2f} ms per step "
          f"(cProfile {'on' if os.environ.get('PROFILE', '1') == '1' else 'off'})")
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
