"""Tensor parallelism (issue 22, item 1) on the CPU with gloo: ranks are mp-executor workers.

Greedy answers at TP=2 equal one rank's token for token (tiny random Llama and Qwen3 in
float32, prefix caching and chunked prefill on, batched), logprobs within float tolerance;
SmolLM2-135M (9 heads, 3 KV heads) at TP=3; each rank holds about 1/N of the weights; what
TP cannot split yet is a clear error."""
from __future__ import annotations

import random

import pytest
import torch

from folio import LLM, SamplingParams
from folio.model.default_model import default_model_path
from folio.model.discovery import ModelSource, load_hf_config
from folio.model.families import arch_spec_from_hf_config
from folio.model.loader import iter_checkpoint_weights, load_model
from folio.model.tensor_parallel import (Part, TPGroup, check_tp_support, head_parts,
                                         local_spec, read_part, vocab_part)

pytestmark = pytest.mark.slow


def _prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 49000) for _ in range(40)]
    out = []
    for i in range(n):
        own = [rng.randrange(3, 49000) for _ in range(rng.randint(4, 70))]
        # a third share a 40-token prefix: prefix-cache hits across the batch
        out.append({"prompt_token_ids": (shared + own) if i % 3 == 0 else own})
    return out


def _answers(model: str, tp: int, prompts, **kw):
    llm = LLM(model, dtype="float32", max_model_len=256, tensor_parallel_size=tp,
              kv_cache_memory_bytes=1 << 26, enable_prefix_caching=True,
              max_num_batched_tokens=64, max_num_seqs=8, **kw)   # small budget: chunked
    try:
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=3)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    finally:
        llm.llm_engine.shutdown()


def _assert_same(got, expected) -> None:
    for i, ((ids, lps), (e_ids, e_lps)) in enumerate(zip(got, expected)):
        assert ids == e_ids, f"prompt {i}"
        for row, e_row in zip(lps, e_lps):
            for token, lp in e_row.items():
                assert token in row and abs(row[token].logprob - lp.logprob) < 1e-3


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_greedy_equals_one_rank(tiny_model_dir, arch):
    model = tiny_model_dir(arch)
    prompts = _prompts(15, seed=1)
    _assert_same(_answers(model, 2, prompts), _answers(model, 1, prompts))


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_one_rank_through_the_distributed_path_equals_in_process(tiny_model_dir, arch):
    """distributed_single_rank: one mp worker that joins a gloo group of world size 1 and
    runs the tensor-parallel code path (vocabulary-parallel embedding and logits gathered,
    all-reduces after attention, the MLP and the experts; the next test checks the model is
    built so) -- what N ranks run, on one device (on the GPU: NCCL) -- answers as the
    in-process engine does."""
    model = tiny_model_dir(arch)
    prompts = _prompts(6, seed=7)
    got = _answers(model, 1, prompts, distributed_executor_backend="mp",
                   distributed_single_rank=True)
    _assert_same(got, _answers(model, 1, prompts))


def test_one_rank_group_is_sharded_and_joins_gloo(tiny_model_dir):
    """join_parallel at world size 1 with single_rank: a real gloo group, a TPGroup that
    runs the collectives (identity at one rank), and the model built as rank 0 of 1."""
    import torch.distributed as dist
    from folio.worker.worker import join_parallel
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tp = join_parallel(0, 1, 1, f"tcp://127.0.0.1:{port}", torch.device("cpu"),
                       single_rank=True)
    try:
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert tp.sharded and tp.size == 1
        x = torch.arange(6.0).reshape(2, 3)
        assert torch.equal(tp.all_reduce(x.clone()), x)
        assert torch.equal(tp.all_gather_last(x), x)
        source = ModelSource("hf_dir", tiny_model_dir("llama"))
        cfg, _ = load_hf_config(source)
        model, _ = load_model(source, cfg, torch.float32, torch.device("cpu"), 256, tp=tp)
        assert type(model.embed_tokens).__name__ == "VocabParallelEmbedding"
        assert all(layer.self_attn.o_proj.tp_reduce is tp for layer in model.layers)
    finally:
        dist.destroy_process_group()


def test_single_rank_needs_one_rank_on_a_process_executor():
    from folio.config import ParallelConfig
    with pytest.raises(ValueError, match="distributed_single_rank"):
        ParallelConfig(distributed_single_rank=True)                      # in process
    with pytest.raises(ValueError, match="distributed_single_rank"):
        ParallelConfig(distributed_single_rank=True, tensor_parallel_size=2)
    assert ParallelConfig(distributed_single_rank=True,
                          distributed_executor_backend="mp").joins_process_group


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "gpt_oss"])
def test_expert_parallel_tp2_equals_one_rank(tiny_model_dir, arch):
    """--enable-expert-parallel: each rank runs half the experts (whole) on every token and
    the ranks' outputs are summed; Mixtral (per-expert checkpoint tensors), Qwen2-MoE (a
    shared expert, split like a dense MLP, and a dense layer) and GPT-OSS (stacked,
    transposed expert tensors with biases; attention sinks split by head)."""
    model = tiny_model_dir(arch)
    prompts = _prompts(8, seed=4)
    _assert_same(_answers(model, 2, prompts, enable_expert_parallel=True),
                 _answers(model, 1, prompts))


def test_expert_load_is_counted_per_rank(tiny_model_dir):
    """Each rank counts the (token, expert) pairs its experts ran: together every routed
    pair of every token the forward passes saw, top_k per token per MoE layer."""
    from transformers import AutoConfig
    model = tiny_model_dir("mixtral")
    cfg = AutoConfig.from_pretrained(model)
    llm = LLM(model, dtype="float32", max_model_len=256, tensor_parallel_size=2,
              enable_expert_parallel=True, kv_cache_memory_bytes=1 << 26,
              enable_prefix_caching=False)
    try:
        prompt, max_tokens = list(range(100, 130)), 8
        llm.generate([{"prompt_token_ids": prompt}],
                     SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                     use_tqdm=False)
        load = llm.llm_engine.engine_core.scheduler.stats().expert_load_per_rank
    finally:
        llm.llm_engine.shutdown()
    forwarded = len(prompt) + max_tokens - 1     # the last token is sampled, never fed
    assert len(load) == 2 and min(load) > 0
    assert sum(load) == forwarded * cfg.num_experts_per_tok * cfg.num_hidden_layers


def test_smollm2_tp3_equals_one_rank():
    model = default_model_path()
    prompts = _prompts(6, seed=2)
    # the GGUF's converted float weights on every rank count (its packed planes are not split)
    _assert_same(_answers(model, 3, prompts), _answers(model, 1, prompts, quantization="none"))


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_a_rank_holds_its_share_of_the_weights(tiny_model_dir):
    """Loading needs no collective: each rank's model is built here in turn and its resident
    parameter bytes measured; the norms (replicated) are the only excess over 1/N."""
    source = ModelSource("hf_dir", tiny_model_dir("qwen3"))
    cfg, _ = load_hf_config(source)
    whole, _ = load_model(source, cfg, torch.float32, torch.device("cpu"), 256)
    total = _weight_bytes(whole)
    for rank in range(2):
        part, spec = load_model(source, cfg, torch.float32, torch.device("cpu"), 256,
                                tp=TPGroup(rank, 2))
        assert abs(_weight_bytes(part) / total - 0.5) < 0.05
        assert (spec.num_heads, spec.num_kv_heads) == (2, 1)
        # rank 1's first q row is head 2's first row of the checkpoint
        q_rows = part.layers[0].self_attn.qkv_proj.weight[:spec.num_heads * spec.head_dim]
        full_q = whole.layers[0].self_attn.qkv_proj.weight[:4 * spec.head_dim]
        assert torch.equal(q_rows, full_q[rank * 2 * spec.head_dim:(rank + 1) * 2 * spec.head_dim])


def test_a_rank_holds_its_share_of_the_experts(tiny_model_dir):
    source = ModelSource("hf_dir", tiny_model_dir("qwen3_moe"))
    cfg, _ = load_hf_config(source)
    whole, _ = load_model(source, cfg, torch.float32, torch.device("cpu"), 256)
    layer = 1   # decoder_sparse_step 2: layer 1 is the sparse one
    for rank in range(2):
        part, _ = load_model(source, cfg, torch.float32, torch.device("cpu"), 256,
                             tp=TPGroup(rank, 2, expert_parallel=True))
        experts = part.layers[layer].mlp.experts
        assert experts.num_experts == 4 and experts.expert_offset == 4 * rank
        full = whole.layers[layer].mlp.experts.gate_up_proj
        assert torch.equal(experts.gate_up_proj, full[4 * rank:4 * rank + 4])
        assert abs(_weight_bytes(part) / _weight_bytes(whole) - 0.5) < 0.05


def test_lazy_reads_take_only_the_slice(tiny_model_dir):
    source = ModelSource("hf_dir", tiny_model_dir("llama"))
    for name, lazy in iter_checkpoint_weights(source, lazy=True):
        if name.endswith("down_proj.weight"):
            rows, cols = lazy.get_shape()
            part = read_part(lazy, 1, Part(cols, cols // 2, cols // 2))
            assert tuple(part.shape) == (rows, cols // 2)
            assert torch.equal(part, lazy[:][:, cols // 2:])
            break
    else:
        raise AssertionError("no down_proj in the checkpoint")


def test_shapes_split_and_replicate():
    spec = arch_spec_from_hf_config(load_hf_config(ModelSource("hf_dir", default_model_path())
                                                   )[0])
    assert (spec.num_heads, spec.num_kv_heads) == (9, 3)
    local = local_spec(spec, 3)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, 512)
    # more ranks than KV heads: ranks share one (2 KV heads, 4 ranks: heads 0, 0, 1, 1)
    from dataclasses import replace
    narrow = replace(spec, num_heads=8, num_kv_heads=2)
    starts = [head_parts(narrow, TPGroup(r, 4))["k"].start // spec.head_dim for r in range(4)]
    assert starts == [0, 0, 1, 1]
    # a vocabulary that does not divide: the last rank's rows are padding past the end
    assert vocab_part(10, TPGroup(1, 3)) == Part(10, 4, 4)
    padded = read_part(torch.arange(10.0).view(10, 1), 0, vocab_part(10, TPGroup(2, 3)))
    assert padded.view(-1).tolist() == [8.0, 9.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_tp_support(spec, 2)


def test_unsupported_models_and_settings_are_clear_errors(tiny_model_dir):
    with pytest.raises(ValueError, match="--enable-expert-parallel"):
        LLM(tiny_model_dir("mixtral"), dtype="float32", max_model_len=128,
            tensor_parallel_size=2)
    with pytest.raises(ValueError, match="latent-attention"):
        LLM(tiny_model_dir("deepseek_v2"), dtype="float32", max_model_len=128,
            tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(default_model_path(), max_model_len=128, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(default_model_path(), tensor_parallel_size=0)


def test_served_with_tensor_parallel_size(tiny_model_dir):
    """`folio serve --tensor-parallel-size 2`: the official client's streamed and plain
    answers equal the offline single-rank engine's."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "entrypoints"))
    from server_utils import RemoteServer
    model = tiny_model_dir("llama")
    prompt = [11, 420, 7, 3051, 99, 1200]
    llm = LLM(model, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 26)
    expected = llm.generate([{"prompt_token_ids": prompt}],
                            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    llm.llm_engine.shutdown()
    with RemoteServer([model, "--dtype", "float32", "--max-model-len", "256",
                       "--tensor-parallel-size", "2", "--kv-cache-memory-bytes",
                       str(1 << 26)]) as server:
        client = server.client()
        plain = client.completions.create(model=model, prompt=prompt, max_tokens=16,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert plain.choices[0].text == expected
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=16,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream) == expected
        assert "2 worker processes ready" in server.log()
