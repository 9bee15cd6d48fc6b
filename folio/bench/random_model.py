"""Random-weights models for `folio bench throughput --random-weights --config NAME`.

``--random-weights --config NAME`` builds (once, cached) a model directory with a real model's
shapes and random bf16 weights, for benchmarking big shapes without downloading checkpoints.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from typing import Any

# Shapes of the models `--random-weights --config NAME` can build (from their published
# config.json files). Only shapes matter for speed; the weights are random.
RANDOM_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        max_position_embeddings=40960, rms_norm_eps=1e-6, hidden_act="silu",
        attention_bias=False),
    "llama3-8b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
        max_position_embeddings=8192, rms_norm_eps=1e-5, hidden_act="silu",
        attention_bias=False, mlp_bias=False),
}
_RANDOM_WEIGHTS_SEED = 0          # fixed: the same NAME always gives the same weights
_RANDOM_MARKER = "folio_random.json"
_SHARD_BYTES = 2 << 30            # keeps the builder's peak memory near one shard


def random_model_dir(name: str, num_layers: int | None = None) -> str:
    from folio.model.default_model import folio_cache_dir
    suffix = f"-L{num_layers}" if num_layers is not None else ""
    return os.path.join(folio_cache_dir(), "random", f"{name}{suffix}")


def build_random_model(name: str, out_dir: str | None = None,
                       num_layers: int | None = None) -> str:
    """An HF directory with the shapes of RANDOM_CONFIGS[name] and random bf16 weights (fixed
    seed), plus the default model's tokenizer (vocab 49152: random prompts only need ids below
    the *model's* vocab). Built once, into a temp dir renamed into place, so a crash never
    leaves a half-written model; later calls return the cached directory."""
    if name not in RANDOM_CONFIGS:
        raise ValueError(f"unknown --config {name!r}; known: {sorted(RANDOM_CONFIGS)}")
    spec = dict(RANDOM_CONFIGS[name])
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        spec["num_hidden_layers"] = num_layers
    final = out_dir or random_model_dir(name, num_layers)
    marker = os.path.join(final, _RANDOM_MARKER)
    stamp = {"name": name, "seed": _RANDOM_WEIGHTS_SEED, "config": spec}
    if os.path.isfile(marker):
        with open(marker, encoding="utf-8") as f:
            if json.load(f) == json.loads(json.dumps(stamp)):
                return final
        raise ValueError(f"{final} holds a different random model; remove it to rebuild")

    parent = os.path.dirname(os.path.abspath(final))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.tmp-", dir=parent)
    try:
        _write_random_model(spec, tmp)
        with open(os.path.join(tmp, _RANDOM_MARKER), "w", encoding="utf-8") as f:
            json.dump(stamp, f, indent=2)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(marker):  # not a concurrent builder that got there first
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_random_model(spec: dict[str, Any], out: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from folio.model.default_model import default_model_path

    # FOLIO_RANDOM_TOKENIZER: any tokenizer directory (machines without the default model's
    # package, such as a GPU box, carry one); ids only need to fit the model's vocab.
    tokenizer = AutoTokenizer.from_pretrained(os.environ.get("FOLIO_RANDOM_TOKENIZER") or default_model_path())
    kwargs = dict(spec)
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(
        model_type, **kwargs, dtype="bfloat16", initializer_range=0.02,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
        else tokenizer.eos_token_id)
    # The meta device gives every parameter's name and shape without allocating the model;
    # the tensors are then made one at a time, so memory stays near one shard.
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    shapes = [(name, tuple(t.shape)) for name, t in meta_model.state_dict().items()
              if not (config.tie_word_embeddings and name == "lm_head.weight")]
    del meta_model

    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    shard_bytes = 0
    for name, shape in shapes:
        size = math.prod(shape) * 2  # bf16
        if shards[-1] and shard_bytes + size > _SHARD_BYTES:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, shape))
        shard_bytes += size

    generator = torch.Generator().manual_seed(_RANDOM_WEIGHTS_SEED)
    weight_map: dict[str, str] = {}
    total = 0
    for index, shard in enumerate(shards):
        file = ("model.safetensors" if len(shards) == 1
                else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors")
        tensors = {}
        for name, shape in shard:
            if name.endswith("norm.weight"):
                tensor = torch.ones(shape, dtype=torch.bfloat16)   # RMSNorm gains
            elif name.endswith(".bias"):
                tensor = torch.zeros(shape, dtype=torch.bfloat16)
            else:
                tensor = torch.empty(shape, dtype=torch.float32).normal_(
                    0.0, config.initializer_range, generator=generator).to(torch.bfloat16)
            tensors[name] = tensor
            weight_map[name] = file
            total += tensor.numel() * 2
        save_file(tensors, os.path.join(out, file), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        with open(os.path.join(out, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)

