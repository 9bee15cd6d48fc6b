"""Pipeline parallelism (issue 22, item 2) on the CPU with gloo: each stage is an mp-executor
worker holding its layers, the residual stream passed on with torch.distributed send/recv.

Greedy answers at PP=2 equal one rank's token for token (tiny random Llama and Qwen3 in
float32, prefix caching and chunked prefill on, batched), logprobs within float tolerance;
an uneven --pp-layer-partition; TP=2 x PP=2 (four ranks); SmolLM2-135M (tied embeddings:
the last stage holds the output matrix) at PP=3; several steps in flight at once; each
stage holds only its layers; what the pipeline does not run yet is a clear error."""
from __future__ import annotations

import pytest

from folio import LLM, SamplingParams
from folio.model.default_model import default_model_path
from folio.model.pipeline_parallel import partition_layers, stage_of

from test_tensor_parallel import _answers as _tp_answers, _assert_same, _prompts

pytestmark = pytest.mark.slow


def _llm(model: str, **kw) -> LLM:
    return LLM(model, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 26,
               enable_prefix_caching=True, max_num_batched_tokens=64, max_num_seqs=8,
               **kw)   # small budget: chunked


def _answers(model: str, prompts, **kw):
    return _tp_answers(model, kw.pop("tensor_parallel_size", 1), prompts, **kw)


def test_layer_partitions() -> None:
    assert partition_layers(8, 2) == [range(0, 4), range(4, 8)]
    assert partition_layers(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert partition_layers(8, 2, "3,5") == [range(0, 3), range(3, 8)]
    for bad, match in [("3,4", "8 layers in all"), ("8,0", "at least one layer"),
                       ("4,4,0", "3 stages given"), ("a,b", "comma-separated")]:
        with pytest.raises(ValueError, match=match):
            partition_layers(8, 2, bad)
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        partition_layers(2, 3)
    # rank = stage * TP + tp_rank: TP=2 x PP=2, rank 3 is stage 1's second rank
    stage = stage_of(3, 2, 2, 8)
    assert (stage.stage, stage.layers, stage.prev_rank, stage.next_rank) == (1, range(4, 8), 1, None)
    first = stage_of(1, 2, 2, 8)
    assert (first.is_first, first.is_last, first.next_rank) == (True, False, 3)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_pp2_greedy_equals_one_rank(tiny_model_dir, arch) -> None:
    model = tiny_model_dir(arch)
    prompts = _prompts(15, seed=1)
    _assert_same(_answers(model, prompts, pipeline_parallel_size=2), _answers(model, prompts))


def test_uneven_partition_and_tp2_x_pp2(tiny_model_dir) -> None:
    """The tiny Llama's layers split 1 + rest, and four ranks: two stages of two
    tensor-parallel ranks each (each stage its own all-reduce group)."""
    model = tiny_model_dir("llama")      # 3 layers
    prompts = _prompts(8, seed=3)
    want = _answers(model, prompts)
    _assert_same(_answers(model, prompts, pipeline_parallel_size=2,
                          pp_layer_partition="1,2"), want)
    _assert_same(_answers(model, prompts, pipeline_parallel_size=2, tensor_parallel_size=2),
                 want)


def test_smollm2_pp3_equals_one_rank() -> None:
    """Real weights with tied embeddings: the first stage embeds, the last holds the
    embedding as its output matrix; 30 layers over 3 stages."""
    model = default_model_path()
    prompts = _prompts(6, seed=2)
    _assert_same(_answers(model, prompts, pipeline_parallel_size=3),
                 _answers(model, prompts, quantization="none"))


def test_steps_overlap_and_each_stage_holds_its_layers(tiny_model_dir) -> None:
    """With 8 requests, two steps are in flight at once (each of other requests), and each
    stage's KV cache and weights are about half the model's."""
    model = tiny_model_dir("llama")
    llm = _llm(model, pipeline_parallel_size=2)
    try:
        core = llm.llm_engine.engine_core
        engine = llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        for i, prompt in enumerate(_prompts(8, seed=5)):
            engine.add_request(str(i), prompt, params)
        depths = []
        while engine.has_unfinished_requests():
            engine.step()
            depths.append(len(core._pipeline))
        assert max(depths) == 2
    finally:
        engine.shutdown()


def test_a_stage_loads_only_its_layers(tiny_model_dir) -> None:
    """Stage 0 of 2 holds the embedding and layer 0, stage 1 layers 1-2, the final norm and
    the output matrix: together exactly the model's weights, each the same tensors."""
    import torch
    from folio.model.discovery import ModelSource, load_hf_config
    from folio.model.loader import load_model
    source = ModelSource("hf_dir", tiny_model_dir("llama"))    # 3 layers, untied
    cfg, _ = load_hf_config(source)
    cpu = torch.device("cpu")
    whole = dict(load_model(source, cfg, torch.float32, cpu, 256)[0].named_parameters())
    stages = [dict(load_model(source, cfg, torch.float32, cpu, 256,
                              pp=stage_of(rank, 1, 2, 3, "1,2"))[0].named_parameters())
              for rank in range(2)]
    assert {name.split(".")[1] for name in stages[0] if name.startswith("layers.")} == {"0"}
    assert {name.split(".")[1] for name in stages[1] if name.startswith("layers.")} == {"1", "2"}
    assert "embed_tokens.weight" in stages[0] and "lm_head.weight" not in stages[0]
    assert "norm.weight" in stages[1] and "embed_tokens.weight" not in stages[1]
    assert set(stages[0]) | set(stages[1]) == set(whole)
    assert not set(stages[0]) & set(stages[1])
    for stage in stages:
        for name, param in stage.items():
            assert torch.equal(param, whole[name]), name


def test_what_the_pipeline_does_not_run_is_a_clear_error(tiny_model_dir) -> None:
    model = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="speculative decoding"):
        _llm(model, pipeline_parallel_size=2,
             speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="pp_layer_partition"):
        _llm(model, pipeline_parallel_size=2, pp_layer_partition="1,1,1")
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        _llm(model, pipeline_parallel_size=0)
