"""LoRA adapters for the tests, written by peft itself (the format users have), with random
A and B (peft's default B = 0 would leave the model unchanged), and peft as the reference."""
from __future__ import annotations

import os
from typing import Any

# Three adapters that differ in rank, targets, scaling rule and per-module overrides.
ADAPTERS: dict[str, dict[str, Any]] = {
    "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all16rs": dict(r=16, lora_alpha=32, use_rslora=True,
                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj"]),
    "mlp4": dict(r=4, lora_alpha=8, target_modules=["o_proj", "up_proj", "down_proj"],
                 rank_pattern={"down_proj": 12}, alpha_pattern={"up_proj": 3}),
}


def make_adapter(base_dir: str, out_dir: str, seed: int, std: float = 0.05,
                 **lora_kwargs: Any) -> str:
    """A PEFT LoRA adapter of `base_dir`'s model saved in `out_dir` (adapter_config.json +
    adapter_model.safetensors), its A and B drawn from N(0, std) with `seed`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0,
                                            **lora_kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.save_pretrained(out_dir)
    assert os.path.isfile(os.path.join(out_dir, "adapter_model.safetensors"))
    return out_dir


def peft_greedy(base_dir: str, adapter_dir: str | None, prompts: list[list[int]],
                max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations by transformers (+ peft's adapter when given), one prompt at a
    time, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                               max_new_tokens=max_new_tokens, do_sample=False,
                               pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs
