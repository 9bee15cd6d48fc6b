"""Loading a model's weights (safetensors, PyTorch .bin or GGUF) into the decoder on a device.

Finding the model and reading its config is discovery.py's (torch-free, shared with the front
end); this module is the engine core's.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Any, Iterator

import torch

from folio.model.attention import get_attention_backend
from folio.model.attention.fp8 import is_fp8
from folio.model.decoder import DecoderLM, MissingLayer, make_rotaries
from folio.model.discovery import ModelSource
from folio.model.families import ArchSpec, arch_spec_from_hf_config, decoder_weight_name
from folio.model.kernel_config import KernelConfig, resolve_kernel_config
from folio.model.pipeline_parallel import WHOLE, PPStage
from folio.model.moe.layer import FusedMoE
from folio.model.quant.scheme import CHECKPOINT_METHODS, ON_LOAD_FP8, parse_quant_config
from folio.model.tensor_parallel import (SINGLE, TPGroup, check_tp_support, local_spec,
                                         plan_shards)

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def resolve_dtype(dtype: str, hf_config: Any, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = _DTYPES.get(config_dtype, torch.float32)
    if config_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        config_dtype = torch.float32
    if device.type == "cpu" and config_dtype == torch.float16:
        return torch.bfloat16  # CPU float16 kernels are slow and narrow-ranged
    if device.type == "cuda" and config_dtype == torch.float32:
        return torch.bfloat16  # float32 halves the GPU's matmul rate and doubles the bytes
    return config_dtype


def iter_checkpoint_weights(source: ModelSource, lazy: bool = False
                            ) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every checkpoint tensor. `lazy`: safetensors tensors come as
    slices that read only what is indexed (tensor parallelism: each rank reads its part);
    each is valid until the next item."""
    if source.kind == "gguf":
        from folio.model.gguf_loader import read_gguf
        yield from read_gguf(source.path).state_dict.items()
        return
    for name, tensor in _checkpoint_files(source.path, lazy):
        yield name, tensor


def iter_decoder_weights(source: ModelSource, hf_config: Any, lazy: bool = False
                         ) -> Iterator[tuple[str, Any]]:
    """The decoder's tensors, under the decoder's names: a vision-language checkpoint's text
    weights renamed, its vision weights left out; any other checkpoint's as they are."""
    # (called as the loaders always called it: tests stand in for it with one argument)
    weights = iter_checkpoint_weights(source, lazy=True) if lazy else \
        iter_checkpoint_weights(source)
    if getattr(hf_config, "vision_language", None) is None:
        yield from weights
        return
    for name, tensor in weights:
        local = decoder_weight_name(name)
        if local is not None:
            yield local, tensor


def _checkpoint_files(path: str, lazy: bool) -> Iterator[tuple[str, Any]]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, name) for name in files]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        from safetensors import safe_open
        for file in files:
            try:
                with safe_open(file, framework="pt") as handle:
                    for name in handle.keys():
                        yield name, (handle.get_slice(name) if lazy
                                     else handle.get_tensor(name))
            except FileNotFoundError as exc:
                raise ValueError(f"weight file {file} is missing") from exc
            except Exception as exc:
                raise ValueError(f"could not read weight file {file}: {exc}") from exc
        return
    bins = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not bins:
        raise ValueError(f"no weights (*.safetensors or pytorch_model*.bin) in {path!r}")
    for file in bins:
        try:
            # weights_only: a pickle can run code; only tensors are accepted.
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise ValueError(f"could not read weight file {file}: {exc}") from exc
        yield from state.items()


def new_decoder(spec: ArchSpec, hf_config: Any, device: torch.device, max_model_len: int,
                kernel_config: KernelConfig, tp: TPGroup = SINGLE,
                pp: PPStage = WHOLE) -> DecoderLM:
    """The decoder on the meta device, its attention backend picked for `device`. The caller
    casts it to the model's dtype and materialises it on the device once (`to_empty`): no time
    on random init, and no float32 copy of the weights on the way."""
    backend = get_attention_backend(device, kernel_config)
    with torch.device("meta"):
        return DecoderLM(spec, hf_config, backend, max_positions=max(max_model_len, 1),
                         kernels=kernel_config, tp=tp, pp=pp)


def install_rotaries(model: DecoderLM, hf_config: Any, device: torch.device,
                     max_model_len: int) -> None:
    """The rotary tables were meta buffers; build them for real, in float32 (positions need
    the precision; they are cast to the activation dtype at each use, as transformers does)."""
    with torch.device(device):
        rotaries = make_rotaries(model.spec, max_model_len, hf_config, model.kernel_config)
    for layer, rotary in zip(model.layers, rotaries):
        if not isinstance(layer, MissingLayer):   # another pipeline stage's
            layer.self_attn.rotary = rotary


def load_model(source: ModelSource, hf_config: Any, dtype: torch.dtype, device: torch.device,
               max_model_len: int, *,
               kernel_config: KernelConfig | None = None,
               quantization: str = "none",
               kv_cache_dtype: torch.dtype | None = None,
               tp: TPGroup = SINGLE, pp: PPStage = WHOLE) -> tuple[DecoderLM, ArchSpec]:
    """The model on `device`, its layers and attention backend built with `kernel_config`
    (None: the defaults with the FOLIO_KERNELS / FOLIO_ATTENTION / FOLIO_GEMV overrides, read
    here once; the forward code never reads the environment). `quantization` "gguf": the
    GGUF file's quantized matrices stay packed (folio.model.quant: C++ kernels on the CPU, the
    group-quantized Triton kernel for the projections on CUDA); "int8": every
    projection and the output matrix quantized per output channel as the checkpoint streams
    in (folio.model.quant.int8_install, CPU); "fp8", "compressed-tensors", "awq", "gptq": the
    checkpoint's quantized projections (or, for "fp8" on a float checkpoint, its projections
    quantized on load) run on quantized kernels (folio.model.quant.checkpoint_install).
    `kv_cache_dtype`: the cache's, checked against the architecture before any weight is
    read (None: not checked). `tp`: this rank's tensor-parallel group (size 1: the whole
    model); the returned spec is then the rank's local one (tensor_parallel.local_spec).
    `pp`: this rank's pipeline stage: only its layers are built and read."""
    if quantization == "int8":
        from folio.model.quant import int8_install
        int8_install.check_device(device)  # before anything is built
    if quantization in CHECKPOINT_METHODS:
        parse_quant_config(hf_config, quantization)  # a bad config fails before any weight
    if kernel_config is None:
        kernel_config = resolve_kernel_config()
    spec = arch_spec_from_hf_config(hf_config)
    if spec.is_encoder:
        raise ValueError(f"{hf_config.architectures[0]} is an encoder: it runs with the pooling "
                         "runner only (folio.model.pooling_loader)")
    if spec.mla is not None and kv_cache_dtype is not None and is_fp8(kv_cache_dtype):
        raise ValueError("an FP8 KV cache is not supported for multi-head latent attention "
                         "(DeepSeek) models yet; use --kv-cache-dtype auto")
    fp8_experts = (spec.moe is not None and quantization == "fp8"
                   and parse_quant_config(hf_config, quantization) is ON_LOAD_FP8)
    if spec.mla is not None and quantization != "none":
        raise ValueError(f"quantization {quantization!r} is not supported for latent-attention "
                         "(DeepSeek) models yet (they load in the model's dtype only)")
    if spec.moe is not None and quantization != "none" and not fp8_experts:
        raise ValueError(f"quantization {quantization!r} is not supported for mixture-of-experts "
                         "models yet; --quantization fp8 on a float checkpoint is (the experts "
                         "and projections quantized on load)")
    if tp.sharded or pp.size > 1:
        check_tp_support(spec, tp.size, tp.expert_parallel)
        if quantization != "none":
            raise ValueError(f"tensor_parallel_size={tp.size}, pipeline_parallel_size="
                             f"{pp.size}: quantization {quantization!r} is not supported with "
                             "tensor or pipeline parallelism yet (float weights only)")
        full_spec, spec = spec, local_spec(spec, tp.size)
        model = new_decoder(spec, hf_config, device, max_model_len, kernel_config, tp, pp)
        if tp.sharded:
            plan_shards(model, full_spec, tp)
        model = model.to(dtype=dtype).to_empty(device=device)
        model.load_weights(iter_decoder_weights(source, hf_config, lazy=True))
        install_rotaries(model, hf_config, device, max_model_len)
        model.eval()
        return model, spec
    model = new_decoder(spec, hf_config, device, max_model_len, kernel_config)
    if quantization == "gguf":
        from folio.model.discovery import gguf_file_of
        from folio.model.gguf_loader import read_gguf
        from folio.model.quant import gguf_install
        ckpt = read_gguf(gguf_file_of(source), keep_quantized=True)
        gpu = device.type == "cuda"
        plan, consumed = gguf_install.plan_packed(model, ckpt.quantized, gpu=gpu)
        gguf_install.shrink_packed_params(model, plan)
        model = model.to(dtype=dtype).to_empty(device=device)
        if gpu:
            from folio.model.quant.gguf_gpu import install_packed_gpu
            install_packed_gpu(model, plan, device)
        else:
            gguf_install.install_packed(model, plan, dtype)
        float_weights = list(ckpt.state_dict.items()) + [
            (name, torch.from_numpy(matrix.dequantize()))
            for name, matrix in ckpt.quantized.items() if name not in consumed]
        model.load_weights(float_weights, preloaded=consumed)
    elif quantization == "int8":
        model = int8_install.load_int8(model, iter_decoder_weights(source, hf_config), dtype,
                                       device)
    elif quantization in CHECKPOINT_METHODS:
        from folio.model.quant.checkpoint_install import load_quantized
        config = parse_quant_config(hf_config, quantization)
        model = load_quantized(model, config, iter_decoder_weights(source, hf_config), dtype, device,
                               kernel_config)
        if fp8_experts:
            for module in model.modules():
                if isinstance(module, FusedMoE):
                    module.quantize_fp8()
    else:
        model = model.to(dtype=dtype).to_empty(device=device)
        model.load_weights(iter_decoder_weights(source, hf_config))  # copy_ casts each tensor
    install_rotaries(model, hf_config, device, max_model_len)
    model.eval()
    return model, spec
