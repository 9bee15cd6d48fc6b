"""Random-weights models for `folio bench throughput --random-weights --config NAME`.

``--random-weights --config NAME`` builds (once, cached) a model directory with a real model's
shapes and random bf16 weights, for benchmarking big shapes without downloading checkpoints.

Every tensor has its own generator, seeded from a stable hash of (seed, tensor name)
(`tensor_seed`), so a tensor's values depend on neither the order nor the sharding of the others.
With CUDA the samples are drawn on the GPU (8B normal samples take a minute or more on a CPU and
well under a second there) and copied to the CPU for saving; without it, on the CPU. The two
devices' generators give different values for the same seed, so the marker stamp records which
one built the directory (``"generator": "cuda" | "cpu"``); a cached build from the other device,
or from before per-tensor seeding, is rebuilt in place.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from folio.bench.child_process import in_child

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
    # Mixture of experts (issue 18's H200 targets): 128 experts of 768, 8 per token.
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        vocab_size=151936, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        max_position_embeddings=40960, rms_norm_eps=1e-6, hidden_act="silu",
        attention_bias=False, use_sliding_window=False),
    # Latent attention + MoE (DeepSeek-V2-Lite's shapes; its YaRN rotary left at the default,
    # which costs the same).
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], hidden_size=2048,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, topk_method="greedy", routed_scaling_factor=1.0, vocab_size=102400,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=163840, rms_norm_eps=1e-6, hidden_act="silu",
        attention_bias=False),
    # An encoder for the embeddings benchmark (issue 19's H200 target): BERT-large's shapes.
    # Its vocabulary is the bundled tokenizer's (the texts are tokenized with it).
    "bert-large": dict(
        model_type="bert", architectures=["BertModel"], hidden_size=1024,
        num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
        max_position_embeddings=512, type_vocab_size=2, hidden_act="gelu",
        layer_norm_eps=1e-12, vocab_size=None),
}
_RANDOM_WEIGHTS_SEED = 0          # fixed: the same NAME always gives the same weights
_RANDOM_MARKER = "folio_random.json"
_SHARD_BYTES = 2 << 30            # keeps the builder's peak memory near one shard
_STAMP_KEYS = ("name", "seed", "config")  # what makes it a different *model* (vs. a stale build)


# `--random-quantization`: the projections stored quantized instead of bf16. "w4a16": random
# 4-bit codes with bf16 scales per group of 128 input channels, in compressed-tensors'
# pack-quantized layout (what llmcompressor writes for W4A16), so the INT4 kernels can be
# timed at real shapes without quantizing 8B random weights first. (FP8 needs no variant:
# `--quantization fp8` quantizes the bf16 random weights on load.)
RANDOM_QUANTIZATIONS = ("w4a16",)
_W4A16_GROUP = 128
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_model_dir(name: str, num_layers: int | None = None,
                     quantization: str | None = None) -> str:
    from folio.model.cache_dir import folio_cache_dir
    suffix = f"-L{num_layers}" if num_layers is not None else ""
    suffix += f"-{quantization}" if quantization else ""
    return os.path.join(folio_cache_dir(), "random", f"{name}{suffix}")


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of tensor `name`: a stable hash of (seed, name), below 2**63."""
    digest = hashlib.sha256(f"{seed}:{name}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def generator_device() -> str:
    """Where the random weights are drawn: "cuda" when CUDA is available, else "cpu"."""
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_random_model(name: str, out_dir: str | None = None,
                       num_layers: int | None = None) -> str:
    """An HF directory with the shapes of RANDOM_CONFIGS[name] and random bf16 weights (fixed
    seed), plus the default model's tokenizer (vocab 49152: random prompts only need ids below
    the *model's* vocab). Built once, into a temp dir renamed into place, so a crash never
    leaves a half-written model; later calls return the cached directory."""
    return build_random_model_info(name, out_dir, num_layers)["path"]


def build_random_model_info(name: str, out_dir: str | None = None,
                            num_layers: int | None = None,
                            device: str | None = None,
                            quantization: str | None = None) -> dict[str, Any]:
    """`build_random_model`, reporting what it did: {"path", "built" (False: the cached
    directory was reused), "build_s" (seconds spent building; 0.0 when cached), "generator"}.
    `device` ("cuda" | "cpu") overrides where the weights are drawn (default: `generator_device`)."""
    if name not in RANDOM_CONFIGS:
        raise ValueError(f"unknown --config {name!r}; known: {sorted(RANDOM_CONFIGS)}")
    spec = dict(RANDOM_CONFIGS[name])
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        spec["num_hidden_layers"] = num_layers
    if quantization is not None and quantization not in RANDOM_QUANTIZATIONS:
        raise ValueError(f"unknown random quantization {quantization!r}; known: "
                         f"{list(RANDOM_QUANTIZATIONS)}")
    device = device or generator_device()
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    final = out_dir or random_model_dir(name, num_layers, quantization)
    marker = os.path.join(final, _RANDOM_MARKER)
    stamp = {"name": name, "seed": _RANDOM_WEIGHTS_SEED, "config": spec, "generator": device}
    if quantization is not None:
        stamp["quantization"] = quantization
    stamp = json.loads(json.dumps(stamp))  # as it reads back from the marker
    stale = False
    if os.path.isfile(marker):
        with open(marker, encoding="utf-8") as f:
            found = json.load(f)
        if found == stamp:
            return {"path": final, "built": False, "build_s": 0.0, "generator": device}
        if any(found.get(key) != stamp[key] for key in _STAMP_KEYS):
            raise ValueError(f"{final} holds a different random model; remove it to rebuild")
        # The same model drawn by the other device's generator (or by the old single-generator
        # scheme, with no "generator" key): ours to replace.
        stale = True
        print(f"random weights: {final} was drawn with generator "
              f"{found.get('generator', 'cpu (single stream)')!r}, not {device!r}; rebuilding",
              file=sys.stderr, flush=True)

    parent = os.path.dirname(os.path.abspath(final))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.tmp-", dir=parent)
    start = time.perf_counter()
    try:
        _write_random_model(spec, tmp, device, label=name, quantization=quantization)
        with open(os.path.join(tmp, _RANDOM_MARKER), "w", encoding="utf-8") as f:
            json.dump(stamp, f, indent=2)
        if stale:
            _replace_dir(tmp, final)
        else:
            try:
                os.rename(tmp, final)
            except OSError:
                if not os.path.isfile(marker):  # not a concurrent builder that got there first
                    raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    build_s = time.perf_counter() - start
    print(f"random weights: built {final} in {build_s:.1f} s (generator: {device})", flush=True)
    return {"path": final, "built": True, "build_s": build_s, "generator": device}


def build_random_model_in_child(name: str, num_layers: int | None,
                                quantization: str | None = None) -> dict[str, Any]:
    """`build_random_model_info` in a spawned child (the builder's peak memory and CUDA context
    stay out of the benchmark process), plus "wall_s": the child's whole time, spawn included.
    Prints one line about the model."""
    start = time.perf_counter()
    info = in_child(build_random_model_info, name, None, num_layers, None, quantization)
    info["wall_s"] = time.perf_counter() - start
    how = (f"built in {info['build_s']:.1f} s (generator: {info['generator']})" if info["built"]
           else "cached")
    print(f"random-weights model ({name}): {info['path']} [{how}; {info['wall_s']:.1f} s wall]",
          flush=True)
    return info


def _replace_dir(new: str, final: str) -> None:
    """Put directory `new` at `final`, whose current content (a stale build) is deleted."""
    trash = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.old-",
                             dir=os.path.dirname(os.path.abspath(final)))
    os.rmdir(trash)
    os.rename(final, trash)
    try:
        os.rename(new, final)
    except OSError:
        os.rename(trash, final)  # put the old one back rather than leave nothing
        raise
    shutil.rmtree(trash, ignore_errors=True)


def _write_random_model(spec: dict[str, Any], out: str, device: str = "cpu",
                        label: str = "", quantization: str | None = None) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    from folio.model.default_model import default_model_path

    # FOLIO_RANDOM_TOKENIZER: any tokenizer directory (machines without the default model's
    # package, such as a GPU box, carry one); ids only need to fit the model's vocab.
    tokenizer = AutoTokenizer.from_pretrained(os.environ.get("FOLIO_RANDOM_TOKENIZER") or default_model_path())
    kwargs = dict(spec)
    model_type = kwargs.pop("model_type")
    if kwargs.get("vocab_size") is None:
        kwargs["vocab_size"] = len(tokenizer)
    config = AutoConfig.for_model(
        model_type, **kwargs, dtype="bfloat16", initializer_range=0.02,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
        else tokenizer.eos_token_id)
    # The meta device gives every parameter's name and shape without allocating the model;
    # the tensors are then made one at a time, so memory stays near one shard.
    # An encoder is built as its base model (BertModel: no language-model head).
    auto_class = AutoModel if config.architectures[0].endswith("Model") else AutoModelForCausalLM
    if auto_class is AutoModel:
        # absolute positions: a padded batch (the sentence-transformers peer's) must pad on
        # the right, or its inputs' positions would shift
        tokenizer.padding_side = "right"
    with torch.device("meta"):
        meta_model = auto_class.from_config(config)
    shapes = [(name, tuple(t.shape)) for name, t in meta_model.state_dict().items()
              if not (config.tie_word_embeddings and name == "lm_head.weight")]
    del meta_model
    fixed: dict[str, torch.Tensor] = {}
    if quantization == "w4a16":
        shapes, fixed = _w4a16_shapes(shapes)
        config.quantization_config = _w4a16_config()

    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    shard_bytes = 0
    for name, shape in shapes:
        size = math.prod(shape) * (4 if name.endswith("weight_packed") else 2)
        if shards[-1] and shard_bytes + size > _SHARD_BYTES:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, shape))
        shard_bytes += size

    total_bytes = sum(math.prod(shape) * (4 if name.endswith("weight_packed") else 2)
                      for name, shape in shapes)
    weight_map: dict[str, str] = {}
    total = 0
    start = time.perf_counter()
    print(f"random weights{' (' + label + ')' if label else ''}: {len(shapes)} tensors, "
          f"{total_bytes / 1e9:.2f} GB in {len(shards)} shard(s), drawn on {device}",
          flush=True)
    for index, shard in enumerate(shards):
        file = ("model.safetensors" if len(shards) == 1
                else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors")
        tensors = {}
        for name, shape in shard:
            tensor = fixed[name] if name in fixed else \
                _random_tensor(name, shape, config.initializer_range, device)
            tensors[name] = tensor
            weight_map[name] = file
            total += tensor.numel() * tensor.element_size()
        save_file(tensors, os.path.join(out, file), metadata={"format": "pt"})
        del tensors
        print(f"random weights: shard {index + 1}/{len(shards)} written "
              f"({total / 1e9:.2f}/{total_bytes / 1e9:.2f} GB, "
              f"{time.perf_counter() - start:.1f} s)", flush=True)
    if len(shards) > 1:
        with open(os.path.join(out, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if auto_class is AutoModel:
        _write_sentence_transformers_layout(out, config.max_position_embeddings,
                                            config.hidden_size)


def _write_sentence_transformers_layout(out: str, max_seq_length: int, width: int) -> None:
    """An encoder in sentence-transformers' layout (mean pooling, then normalize), as
    all-MiniLM-L6-v2 ships: folio and the sentence-transformers peer then pool alike."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]
    os.makedirs(os.path.join(out, "1_Pooling"), exist_ok=True)
    os.makedirs(os.path.join(out, "2_Normalize"), exist_ok=True)
    files = {"modules.json": modules,
             "sentence_bert_config.json": {"max_seq_length": max_seq_length,
                                           "do_lower_case": False},
             os.path.join("1_Pooling", "config.json"): {"word_embedding_dimension": width,
                                                        "pooling_mode_mean_tokens": True}}
    for name, content in files.items():
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)


def _w4a16_shapes(shapes: list[tuple[str, tuple[int, ...]]]
                  ) -> tuple[list[tuple[str, tuple[int, ...]]], dict[str, Any]]:
    """The projections' bf16 weights replaced by compressed-tensors' pack-quantized tensors;
    and the `weight_shape` tensors, whose values are the original shapes."""
    import torch
    out, fixed = [], {}
    for name, shape in shapes:
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in _PROJECTIONS:
            n, k = shape
            out += [(f"{module}.weight_packed", (n, k // 8)),
                    (f"{module}.weight_scale", (n, k // _W4A16_GROUP)),
                    (f"{module}.weight_shape", (2,))]
            fixed[f"{module}.weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
        else:
            out.append((name, shape))
    return out, fixed


def _w4a16_config() -> dict[str, Any]:
    """compressed-tensors' quantization_config of a W4A16 (group 128, symmetric) model, as
    llmcompressor's W4A16 scheme writes it."""
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": None, "output_activations": None,
                "format": "pack-quantized",
                "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                            "strategy": "group", "group_size": _W4A16_GROUP,
                            "dynamic": False, "actorder": None, "observer": "minmax"}}}}


def _random_tensor(name: str, shape: tuple[int, ...], std: float, device: str) -> "torch.Tensor":
    """Tensor `name` as saved (bf16, on the CPU): RMSNorm gains are ones, biases zeros, every
    other tensor N(0, std) drawn by its own generator on `device`, seeded by `tensor_seed`.
    W4A16 tensors: uniformly random codes, scales such that the weights' spread is about
    `std` (codes' spread around 8 is ~4.6 steps), the shape as compressed-tensors stores it."""
    import torch
    if name.endswith("weight_packed"):
        generator = torch.Generator(device=device).manual_seed(
            tensor_seed(_RANDOM_WEIGHTS_SEED, name))
        return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device=device,
                             generator=generator).cpu()
    if name.endswith("weight_scale"):
        return torch.full(shape, std / 4.6, dtype=torch.bfloat16)
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)   # RMSNorm gains
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(tensor_seed(_RANDOM_WEIGHTS_SEED, name))
    sample = torch.empty(shape, dtype=torch.float32, device=device).normal_(
        0.0, std, generator=generator)
    return sample.to(torch.bfloat16).cpu()
