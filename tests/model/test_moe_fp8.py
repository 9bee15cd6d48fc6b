"""FP8 experts (`--quantization fp8` on a float mixture-of-experts checkpoint): every projection
and each expert's rows quantized to e4m3 on load with one scale per row. On the CPU the
projections keep their dequantized weights and the experts their codes, widened one expert at
a time (FusedMoE._grouped_torch); the Triton paths' FP8 arithmetic is checked under the
interpreter in test_triton_fused_moe.py.

Reference: the same checkpoint with each of those weights replaced by what its codes stand for
(quantize_fp8_per_channel row by row, then codes * scale), run by transformers in float32."""
from __future__ import annotations

import glob
import os
import shutil
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from folio import LLM, SamplingParams
from folio.model.discovery import ModelSource, load_hf_config, resolve_quantization
from folio.model.loader import load_model
from folio.model.moe.layer import FusedMoE
from folio.model.quant.formats import quantize_fp8_per_channel
from model_utils import hf_greedy_batch, torch_threads

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"]
MAX_TOKENS = 16


def _dequantized(weight: torch.Tensor) -> torch.Tensor:
    """What folio's FP8 codes of `weight` stand for (rows of a 2-D weight; per expert of a
    stacked 3-D one)."""
    if weight.dim() == 3:
        return torch.stack([_dequantized(w) for w in weight])
    q = quantize_fp8_per_channel(weight)
    return (q.codes.to(torch.float32) * q.scale[:, None]).to(weight.dtype)


def _quantized_name(name: str) -> bool:
    """A checkpoint tensor folio quantizes: the decoder layers' projections and experts, not
    the routers (`mlp.gate`, `shared_expert_gate`), norms or biases."""
    if ".layers." not in name or not name.endswith(("weight", "gate_up_proj", "down_proj")):
        return False
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return True
    return name.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight"))


def _write_dequantized(src: str, dst: str, transposed_experts: bool) -> int:
    """`transposed_experts`: GPT-OSS stores stacked experts as [E, K, N] (folio's rows are
    its columns; the gate/up interleave only reorders them)."""
    shutil.copytree(src, dst)
    changed = 0
    for path in glob.glob(os.path.join(dst, "*.safetensors")):
        tensors = load_file(path)
        for name in list(tensors):
            if _quantized_name(name):
                weight = tensors[name]
                if transposed_experts and weight.dim() == 3:
                    tensors[name] = _dequantized(weight.transpose(1, 2)).transpose(1, 2) \
                        .contiguous()
                else:
                    tensors[name] = _dequantized(weight)
                changed += 1
        save_file(tensors, path, metadata={"format": "pt"})
    return changed


def _load(path: str, quantization: str) -> Any:
    source = ModelSource("hf_dir", path)
    hf_config, _ = load_hf_config(source)
    method = resolve_quantization(quantization, source, "cpu", hf_config)
    return load_model(source, hf_config, torch.float32, torch.device("cpu"), 256,
                      quantization=method)[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_experts_quantized_on_load(tiny_model_dir: Callable[[str], str], arch: str) -> None:
    path = tiny_model_dir(arch)
    with torch_threads(1):
        plain, q = _load(path, "none"), _load(path, "fp8")
    experts = [(n, m) for n, m in q.named_modules() if isinstance(m, FusedMoE)]
    assert experts
    for name, module in experts:
        ref = plain.get_submodule(name)
        for proj in ("gate_up_proj", "down_proj"):
            codes = getattr(module, proj)
            scale = getattr(module, proj.replace("_proj", "_scale"))
            assert codes.dtype == torch.float8_e4m3fn, (name, proj)
            assert scale.shape == codes.shape[:2] and scale.dtype == torch.float32
            want = getattr(ref, proj)
            got = codes.to(torch.float32) * scale[:, :, None]
            step = want.abs().amax(dim=2, keepdim=True) / 448 * 32   # e4m3's widest step
            assert torch.all((got - want).abs() <= step / 2 + 1e-8), (name, proj)
            assert torch.equal(got, _dequantized(want)), (name, proj)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_on_dequantized(tiny_model_dir: Callable[[str], str],
                                                    tmp_path, arch: str) -> None:
    path = tiny_model_dir(arch)
    reference = str(tmp_path / f"{arch}-dequantized")
    assert _write_dequantized(path, reference, transposed_experts=arch == "gpt_oss") > 0
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (5, 17, 40, 90)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with torch_threads(1):
        llm = LLM(model=path, quantization="fp8", dtype="float32", max_model_len=256, seed=0,
                  num_gpu_blocks_override=64)
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                   use_tqdm=False)
        finally:
            del llm
        want = hf_greedy_batch(reference, prompts, MAX_TOKENS)
        plain = hf_greedy_batch(path, prompts, MAX_TOKENS)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    assert got == [w.token_ids for w in want], arch
    # the check can fail: the float model's answers differ from the quantized ones somewhere
    assert got != [p.token_ids for p in plain], arch


@pytest.mark.parametrize("arch,quantization,message", [
    ("qwen3_moe", "int8", r"quantization 'int8' is not supported for mixture-of-experts models"),
    ("deepseek_v2", "fp8", r"quantization 'fp8' is not supported for latent-attention"),
])
def test_unsupported_moe_quantization_is_named(tiny_model_dir: Callable[[str], str], arch: str,
                                               quantization: str, message: str) -> None:
    source = ModelSource("hf_dir", tiny_model_dir(arch))
    hf_config, _ = load_hf_config(source)
    with pytest.raises(ValueError, match=message):
        load_model(source, hf_config, torch.float32, torch.device("cpu"), 256,
                   quantization=quantization)
