"""`--quantization int8`: a float checkpoint's projections and output matrix quantized on load
to int8 per output channel (folio/model/quant/int8_install.py, CPU). Tiny random models: every
projection packed, no float weight left, logits as close to the float model's as int8's
rounding allows; the default model's converted HF directory: a quarter of the float32 bytes,
perplexity and greedy chat answers near the float path's; the choice refused on CUDA; the
flag and config accept it."""
from __future__ import annotations

import argparse
from typing import Any, Callable

import pytest
import torch
from torch import nn

from folio.model.discovery import ModelSource, load_hf_config, resolve_model_source
from folio.model.layers import Linear
from folio.model.loader import load_model
from folio.model.quant.gguf_install import PackedEmbedding
from folio.model.quant.int8_packed import PackedInt8Weight
from gguf_cases import CHAT_PROMPTS, license_ids, perplexity, prefill_logits
from model_utils import check_greedy_close, folio_position_dict, torch_threads

CPU = torch.device("cpu")


def _load(path: str, quantization: str, max_len: int = 256) -> nn.Module:
    source = ModelSource("hf_dir", path)
    hf_config, _ = load_hf_config(source)
    return load_model(source, hf_config, torch.float32, CPU, max_len,
                      quantization=quantization)[0]


def _resident_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size()
               for t in [*model.parameters(), *model.buffers()])


def _quantized(model: nn.Module) -> dict[str, PackedInt8Weight]:
    """Module path -> its int8 weight; "lm_head" for the output matrix."""
    found = {name: m.packed for name, m in model.named_modules() if isinstance(m, Linear)}
    found["lm_head"] = model.lm_head_packed
    return found


def _float_weight(plain: nn.Module, name: str) -> torch.Tensor:
    """The float model's weight of what `_quantized` calls `name`."""
    if name == "lm_head":
        return (plain.embed_tokens if plain.lm_head is None else plain.lm_head).weight
    return plain.get_submodule(name).weight


def _check_installed(q: nn.Module, plain: nn.Module, *, values: bool = True) -> None:
    """Every projection (merged ones too) and the output matrix packed as per-channel int8,
    their float weights gone, and (`values`) each weight within half a step of the float
    one."""
    linears = [n for n, m in q.named_modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * len(q.layers)  # qkv, o, gate_up, down
    for name, packed in _quantized(q).items():
        assert isinstance(packed, PackedInt8Weight), name
        assert packed.group == packed.in_features, name  # one scale per output channel
        if name != "lm_head":
            assert q.get_submodule(name).weight.numel() == 0, name
        if values:
            ref = _float_weight(plain, name)
            assert torch.all((packed.dequantize() - ref).abs() <= packed.scale / 2 + 1e-7), name
    if q.lm_head is None:  # tied: the embedding reads its rows from the same codes
        assert isinstance(q.embed_tokens, PackedEmbedding)
        assert q.embed_tokens.packed is q.lm_head_packed
        ids = torch.tensor([0, 7, 49151])
        assert torch.equal(q.embed_tokens(ids), q.lm_head_packed.dequantize()[ids])
    else:
        assert q.lm_head.weight.numel() == 0
        assert torch.equal(q.embed_tokens.weight, plain.embed_tokens.weight)


def _float_twin(path: str, q: nn.Module, perturb: Callable[[torch.Tensor, PackedInt8Weight],
                                                          torch.Tensor]) -> nn.Module:
    """The float model with each quantized weight W replaced by perturb(W, its int8 form)."""
    twin = _load(path, "none")
    modules = dict(twin.named_modules())
    with torch.no_grad():
        for name, packed in _quantized(q).items():
            if name == "lm_head":
                module = twin.embed_tokens if twin.lm_head is None else twin.lm_head
            else:
                module = modules[name]
            module.weight.copy_(perturb(module.weight, packed))
    return twin


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_model_quantized_on_load(tiny_model_dir: Callable[[str], str], arch: str) -> None:
    """llama: a separate lm_head; qwen2: q/k/v biases (added to the int8 matmul's output);
    qwen3: a tied lm_head (the embedding quantized once) and q/k norms.

    The bound on the logits comes from int8's step: a weight is off by at most half a step
    (max|row| / 254), about uniformly, so the weights' relative error is about
    max|row| / (127 * sqrt(12) * rms(row)) = 0.6 % for these Gaussian rows; this random model
    (3 layers, initializer range 0.25) amplifies that ~10x into its logits (4-7 % measured). The test
    gives the float model the same rounding noise (each weight moved uniformly within half
    its row's step) and requires int8's logit error within twice that twin's, and the int8
    model equal to the float model carrying exactly its dequantized weights (float32
    summation order only)."""
    path = tiny_model_dir(arch)
    with torch_threads(1):
        plain, q = _load(path, "none"), _load(path, "int8")
        _check_installed(q, plain)
        # Only int8 codes and their scales stay for the quantized matrices: the model's
        # bytes are the float model's less those weights plus the codes and scales.
        quantized = _quantized(q)
        float_bytes = sum(_float_weight(plain, n).numel() * 4 for n in quantized)
        int8_bytes = sum(_resident_bytes(p) for p in quantized.values())
        assert int8_bytes < 0.27 * float_bytes
        assert _resident_bytes(q) == _resident_bytes(plain) - float_bytes + int8_bytes

        ids = torch.randint(3, 49152, (64,), generator=torch.Generator().manual_seed(0))
        ref = prefill_logits(plain, ids)
        got = prefill_logits(q, ids)
        same_weights = prefill_logits(_float_twin(path, q, lambda w, p: p.dequantize()), ids)
        gen = torch.Generator().manual_seed(1)
        noisy = prefill_logits(_float_twin(
            path, q, lambda w, p: w + (torch.rand(w.shape, generator=gen) - 0.5) * p.scale), ids)

    def rel(a: torch.Tensor) -> float:
        return float((a - ref).norm() / ref.norm())

    assert float((got - same_weights).norm() / same_weights.norm()) < 1e-5
    assert rel(got) < 2 * rel(noisy), (rel(got), rel(noisy))
    assert rel(got) < 0.1
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.75


def test_tiny_model_incomplete_checkpoint_is_refused(tiny_model_dir: Callable[[str], str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantized weight missing (one shard of the merged qkv) or of the wrong shape is
    reported as the float path reports it."""
    from folio.model import loader
    path = tiny_model_dir("llama")
    read = loader.iter_checkpoint_weights

    def without_k(source):
        return ((n, t) for n, t in read(source) if n != "model.layers.1.self_attn.k_proj.weight")

    monkeypatch.setattr(loader, "iter_checkpoint_weights", without_k)
    with pytest.raises(ValueError, match=r"lacks weights: \['layers.1.self_attn.qkv_proj.weight:k"):
        _load(path, "int8")

    def short_o(source):
        return ((n, t[:, :32] if n.endswith("layers.0.self_attn.o_proj.weight") else t)
                for n, t in read(source))

    monkeypatch.setattr(loader, "iter_checkpoint_weights", short_o)
    with pytest.raises(ValueError, match=r"has shape \(64, 32\), expected \(64, 64\)"):
        _load(path, "int8")


def _generate(path: str, quantization: str, prompts: list[Any], max_tokens: int) -> list[Any]:
    from folio import LLM, SamplingParams
    llm = LLM(model=path, dtype="float32", device="cpu", max_model_len=256,
              quantization=quantization, num_gpu_blocks_override=64)
    try:
        assert llm.llm_engine.engine_core.executor.worker.quantization == quantization
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                logprobs=5)
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()


def test_tiny_model_greedy_generation(tiny_model_dir: Callable[[str], str]) -> None:
    """Through the engine (LLM.generate, the tied qwen3): int8's greedy tokens follow the float
    model's; where they part it is a near-tie (vLLM's rule: each side's token in the other's
    top 5), and most tokens come before any parting."""
    path = tiny_model_dir("qwen3")
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 49152, (n,), generator=gen).tolist()}
               for n in (5, 17, 40, 90)]
    with torch_threads(1):
        ref = _generate(path, "none", prompts, 16)
        got = _generate(path, "int8", prompts, 16)
    agreed = 0
    for i, (a, b) in enumerate(zip(got, ref)):
        parted = check_greedy_close(a.token_ids, b.token_ids,
                                    [folio_position_dict(p) for p in a.logprobs],
                                    [folio_position_dict(p) for p in b.logprobs],
                                    name=f"int8 prompt {i}")
        agreed += 16 if parted is None else parted
    assert agreed >= 32, f"{agreed} of 64 tokens before the first difference"


# ---- the default model's converted Hugging Face directory ---------------------------------

# Perplexity of the first 384 tokens of CPython's LICENSE.txt, int8 against the float path.
# Measured: float 15.272, int8 15.460 (+1.23 %). The 1 % (its Q8_0 bound) is not met by
# per-channel int8 on this model: the projections alone give +1.16 % (qkv the most), the tied
# embedding's rows +0.07 % more; int8 in groups of 32 or 64 weights gives +0.61 % / +0.69 %.
PERPLEXITY_BOUND = 0.02


@pytest.fixture(scope="module")
def default_int8():
    from folio.model.default_model import default_model_path
    path = default_model_path()
    return path, _load(path, "none", 512), _load(path, "int8", 512)


def test_default_model_int8_memory(default_int8) -> None:
    """Every projection and the tied output matrix (with the embedding) as int8 codes: the
    model's bytes a quarter of float32's, and the float weights gone."""
    _, plain, q = default_int8
    _check_installed(q, plain, values=False)  # the values: the tiny models' test
    ratio = _resident_bytes(q) / _resident_bytes(plain)
    assert 0.24 < ratio < 0.27, ratio  # int8 codes, a float32 scale per row, float norms


def test_default_model_int8_perplexity(default_int8) -> None:
    _, plain, q = default_int8
    ids = license_ids()
    got, ref = perplexity(q, ids), perplexity(plain, ids)
    assert 1.5 < ref < 50, ref
    assert abs(got / ref - 1) < PERPLEXITY_BOUND, (got, ref)


@pytest.mark.slow
def test_default_model_int8_greedy_chat() -> None:
    """The first 16 greedy tokens of 15 chat prompts through the whole engine (LLM.chat),
    int8 against the float path: where they part it is a near-tie (each side's token in the
    other's top 5), and most tokens come before any parting. Measured: 9 of 15 answers equal,
    84 % of the tokens before the first difference, every difference a swap of the top two
    (gaps of 0.01-0.3 nats; int8 in groups of 32 or 64 weights gives 9 and 8 equal answers:
    this 135M model's answers are full of near-ties). The exact GGUF path's bar (13 of 15,
    test_gguf_packed) is not one per-channel int8 can meet here."""
    from folio import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    chats = [[{"role": "user", "content": text}] for text in CHAT_PROMPTS]
    answers = {}
    for quantization in ("none", "int8"):
        llm = LLM(quantization=quantization, max_model_len=512, device="cpu", dtype="float32")
        try:
            assert llm.llm_engine.engine_core.executor.worker.quantization == quantization
            answers[quantization] = [o.outputs[0]
                                     for o in llm.chat(chats, params, use_tqdm=False)]
        finally:
            llm.llm_engine.shutdown()
    agreed = 0
    for i, (a, b) in enumerate(zip(answers["int8"], answers["none"])):
        parted = check_greedy_close(a.token_ids, b.token_ids,
                                    [folio_position_dict(p) for p in a.logprobs],
                                    [folio_position_dict(p) for p in b.logprobs],
                                    name=f"int8 chat {i}")
        agreed += 16 if parted is None else parted
    total = 16 * len(CHAT_PROMPTS)
    assert agreed >= 0.75 * total, f"{agreed} of {total} tokens before the first difference"


# ---- choosing it ---------------------------------------------------------------------------

def test_int8_choice() -> None:
    """Any model on the CPU (a GGUF file's dequantized weights are re-quantized); on CUDA a
    ValueError, before any weight is read. The default choice is unchanged."""
    from folio.model.discovery import resolve_quantization
    default = resolve_model_source(None)
    plain_dir = ModelSource("hf_dir", "/nonexistent-model-dir")
    gguf = ModelSource("gguf", "/nonexistent/model.gguf")
    for source in (default, plain_dir, gguf):
        assert resolve_quantization("int8", source, "cpu") == "int8"
        with pytest.raises(ValueError, match="quantization 'int8' runs on the CPU only"):
            resolve_quantization("int8", source, "cuda")
    assert resolve_quantization(None, default, "cpu") == "gguf"
    assert resolve_quantization(None, plain_dir, "cpu") == "none"
    # load_model itself refuses too, before reading anything.
    with pytest.raises(ValueError, match="quantization 'int8' runs on the CPU only"):
        load_model(plain_dir, None, torch.float32, torch.device("cuda"), 16,
                   quantization="int8")


def test_int8_config_and_flags() -> None:
    from folio.config import QUANTIZATION_METHODS, ModelConfig
    from folio.engine.arg_utils import add_engine_args, engine_kwargs_from_args
    from folio.entrypoints.openai.cli_args import add_serve_args, build_engine_config
    assert "int8" in QUANTIZATION_METHODS
    assert ModelConfig(quantization="int8").quantization == "int8"
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig(quantization="int4")
    engine = argparse.ArgumentParser()
    add_engine_args(engine)
    assert engine_kwargs_from_args(engine.parse_args(["-q", "int8"]))["quantization"] == "int8"
    serve = argparse.ArgumentParser()
    add_serve_args(serve)
    config = build_engine_config(serve.parse_args(["--quantization", "int8"]))
    assert config.model.quantization == "int8"
    with pytest.raises(SystemExit):
        engine.parse_args(["--quantization", "int4"])
