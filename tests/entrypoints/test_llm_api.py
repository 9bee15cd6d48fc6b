"""The offline API in vLLM's shape, on the embedded default model (SmolLM2-135M-Instruct)."""
from __future__ import annotations

import math

import pytest

from folio import LLM, RequestOutputKind, SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    # No model argument: the embedded default model.
    return LLM(max_model_len=512, num_gpu_blocks_override=256, dtype="float32")


def test_default_model_answers_chat(llm):
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason is None  # ended by EOS
    assert out.prompt.startswith("<|im_start|>system")


def test_generate_prompt_forms_and_output_fields(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("The sky is")
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(["The sky is", {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert len(outs) == 2
    text_out, ids_out = outs
    assert text_out.prompt == "The sky is" and ids_out.prompt is None
    assert text_out.prompt_token_ids == ids_out.prompt_token_ids == ids
    assert text_out.outputs[0].token_ids == ids_out.outputs[0].token_ids
    assert len(text_out.outputs[0].token_ids) == 5
    assert text_out.outputs[0].finish_reason == "length"
    assert text_out.outputs[0].text == tok.decode(text_out.outputs[0].token_ids)
    assert text_out.finished
    metrics = text_out.metrics
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time
    assert metrics.first_token_time <= metrics.last_token_time <= metrics.finished_time
    assert metrics.time_to_first_token > 0 and metrics.e2e_latency >= metrics.time_to_first_token


def test_one_sampling_params_per_prompt(llm):
    outs = llm.generate(["One", "Two"], [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                                         SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)],
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 4]
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["One", "Two"], [SamplingParams()], use_tqdm=False)


def test_chat_batch_and_template_options(llm):
    convs = [QUESTION, [{"role": "user", "content": "Say hi."}]]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(outs) == 2 and outs[0].outputs[0].text.startswith("The capital of France")
    cont = llm.chat(QUESTION + [{"role": "assistant", "content": "The capital of France is"}],
                    SamplingParams(temperature=0, max_tokens=3), add_generation_prompt=False,
                    continue_final_message=True, use_tqdm=False)[0]
    assert cont.prompt.endswith("The capital of France is")
    assert "Paris" in cont.outputs[0].text
    custom = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=1),
                      chat_template="{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:",
                      use_tqdm=False)[0]
    assert custom.prompt == "Q: What is the capital of France?\nA:"


def test_logprobs_and_prompt_logprobs_shape(llm):
    out = llm.generate(["Hello world, this is"], SamplingParams(temperature=0, max_tokens=3, logprobs=4,
                                                                 prompt_logprobs=2), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 3
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        assert token_id in position
        assert position[token_id].rank == 1  # greedy picks the most likely token
        assert 4 <= len(position) <= 5
        assert all(lp.logprob <= 0 and lp.decoded_token is not None for lp in position.values())
    assert math.isclose(completion.cumulative_logprob,
                        sum(p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs)),
                        rel_tol=1e-6)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for token_id, position in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert token_id in position and 2 <= len(position) <= 3


def test_stop_strings_and_tokens(llm):
    base = SamplingParams(temperature=0, max_tokens=32)
    full = llm.chat(QUESTION, base, use_tqdm=False)[0].outputs[0]
    assert full.text == "The capital of France is Paris."
    cut = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32, stop=["France"]),
                   use_tqdm=False)[0].outputs[0]
    assert cut.text == "The capital of " and cut.finish_reason == "stop" and cut.stop_reason == "France"
    kept = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32, stop=["France"],
                                             include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == "The capital of France"
    # A stop string spanning tokens (" is Par" covers two tokens).
    span = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32, stop=["s Par"]),
                    use_tqdm=False)[0].outputs[0]
    assert span.text == "The capital of France i"
    stop_id = full.token_ids[2]
    by_token = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop_id]),
                        use_tqdm=False)[0].outputs[0]
    assert by_token.token_ids == full.token_ids[:3]
    assert by_token.stop_reason == stop_id and by_token.finish_reason == "stop"


def test_min_tokens_and_ignore_eos(llm):
    eos_run = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    n = len(eos_run.token_ids)
    longer = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=40, min_tokens=n + 3),
                      use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= n + 3
    ignored = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=n + 5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(ignored.token_ids) == n + 5 and ignored.finish_reason == "length"


def test_detokenize_false_and_special_tokens(llm):
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32, detokenize=False),
                   use_tqdm=False)[0].outputs[0]
    assert out.text == "" and out.token_ids
    raw = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32, skip_special_tokens=False,
                                            include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert raw.text.startswith("The capital of France is Paris.")


def test_truncate_prompt_tokens(llm):
    tok = llm.get_tokenizer()
    long = " ".join(["word"] * 100)
    out = llm.generate([long], SamplingParams(max_tokens=1, truncate_prompt_tokens=10), use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode(long)[-10:]


def test_streaming_engine_interface(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request("stream-a", "Count: one, two,", params)
    engine.add_request("stream-b", "Letters: a, b,", params)
    engine.add_request("stream-c", "Colours: red, green,", params)
    deltas: dict[str, list] = {"stream-a": [], "stream-b": []}
    aborted_outputs = []
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "stream-c":
                if steps >= 2:
                    pytest.fail("stream-c produced output after it was aborted")
                aborted_outputs.append(out)
            else:
                deltas[out.request_id].append(out)
        steps += 1
        if steps == 2:
            engine.abort_request("stream-c")
    assert aborted_outputs and not any(o.finished for o in aborted_outputs)
    for rid, outs in deltas.items():
        tokens = [t for o in outs for t in o.outputs[0].token_ids]
        assert len(tokens) == 8 and outs[-1].finished
        assert "".join(o.outputs[0].text for o in outs) == llm.get_tokenizer().decode(tokens)
    pool = engine.engine_core.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks


def test_reset_prefix_cache(llm):
    prompt = "A long shared prefix that fills at least one block of sixteen tokens, surely. " * 2
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([prompt], params, use_tqdm=False)
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache()
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 0


def test_progress_bar_runs(llm, capsys):
    outs = llm.generate(["a", "b", "c"], SamplingParams(max_tokens=1), use_tqdm=True)
    assert len(outs) == 3
    assert "Processed prompts" in capsys.readouterr().err
