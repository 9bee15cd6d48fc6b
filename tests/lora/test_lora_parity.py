"""Multi-LoRA against transformers + peft on the real SmolLM2-135M weights (float32, CPU):
one batch that mixes three peft adapters (different ranks, targets, rsLoRA, rank and alpha
patterns) and the base model gives, for every request, the tokens peft gives that request
run alone — with two device slots for the three adapters (swapping) and one host slot
(reloading from the files), and the same prompts under every adapter (the prefix cache
must keep them apart)."""
from __future__ import annotations

import pytest

from lora_utils import ADAPTERS, make_adapter, peft_greedy

pytest.importorskip("peft")

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village,"]
MAX_NEW = 16


@pytest.fixture(scope="module")
def adapters(smollm2_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(smollm2_dir, str(root / name), seed=i + 1, **kwargs)
            for i, (name, kwargs) in enumerate(ADAPTERS.items())}


def test_mixed_batch_matches_peft(smollm2_dir, smollm2_tokenizer, adapters):
    from folio import LLM, LoRARequest, SamplingParams

    prompts = [smollm2_tokenizer.encode(p) for p in PROMPTS]
    want = {None: peft_greedy(smollm2_dir, None, prompts, MAX_NEW)}
    for name, path in adapters.items():
        want[name] = peft_greedy(smollm2_dir, path, prompts, MAX_NEW)
    # the adapters change the answers, or the comparison would prove nothing
    for name in adapters:
        assert want[name] != want[None], name

    llm = LLM(smollm2_dir, dtype="float32", quantization="none", device="cpu",
              max_model_len=256, kv_cache_memory_bytes=1 << 27, enable_lora=True,
              max_loras=2, max_cpu_loras=2, max_lora_rank=16,
              distributed_executor_backend="uni")
    requests = {None: None} | {name: LoRARequest(name, i + 1, path)
                               for i, (name, path) in enumerate(adapters.items())}
    # interleaved: base, a1, a2, a3, base, a1, ...
    order = [(name, j) for j in range(len(prompts)) for name in requests]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompts[j]} for _, j in order], params,
                        lora_request=[requests[name] for name, _ in order], use_tqdm=False)
    got = {}
    for (name, j), out in zip(order, outs):
        got.setdefault(name, [None] * len(prompts))[j] = list(out.outputs[0].token_ids)
    for name in requests:
        assert got[name] == want[name], f"adapter {name}: {got[name]} != peft {want[name]}"
    worker = llm.llm_engine.engine_core.executor.worker
    assert worker.lora.num_loads >= 3
