"""The output processor's stop strings over steps that bring several tokens (speculative
decoding's kept drafts): the output ends at the token that completed the stop string."""
from __future__ import annotations

from folio.core.engine_core_outputs import EngineCoreOutput, SampledTokenLogprobs
from folio.engine.output_processor import OutputProcessor
from folio.sampling_params import SamplingParams


def _entry(token_id: int) -> SampledTokenLogprobs:
    return SampledTokenLogprobs(token_id, -0.5, 1, [token_id], [-0.5])


def _run(tokenizer, ids: list[int], finish_reason: str | None, **params):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", ["r"], None, [1, 2, 3],
                          [SamplingParams(max_tokens=len(ids), logprobs=0, **params)], 0.0)
    outputs, stopped = processor.process([EngineCoreOutput(
        "r", list(ids), [_entry(t) for t in ids], finish_reason=finish_reason,
        stop_reason=None)])
    return outputs[0].outputs[0], stopped


def test_a_step_of_several_tokens_ends_at_the_stop_string(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    n = next(i for i in range(1, len(ids) + 1) if "gam" in tok.decode(ids[:i]))
    assert n < len(ids)
    out, stopped = _run(tok, ids, None, stop=["gam"])
    assert list(out.token_ids) == ids[:n] and len(out.logprobs) == n
    assert (out.text, out.finish_reason, out.stop_reason) == ("alpha beta ", "stop", "gam")
    assert stopped == ["r"]            # the core must be told: it has not finished the request
    # the core finished the request in the same step (max_tokens): the stop string came
    # first, so it is the finish, and the core is not told again
    out, stopped = _run(tok, ids, "length", stop=["gam"], include_stop_str_in_output=True)
    assert list(out.token_ids) == ids[:n] and out.text == "alpha beta gam"
    assert (out.finish_reason, out.stop_reason, stopped) == ("stop", "gam", [])
    # without a stop string in the text every token is kept, with the core's finish
    out, _ = _run(tok, ids, "length", stop=["zzz"])
    assert list(out.token_ids) == ids and out.finish_reason == "length"


def test_stop_strings_wait_for_min_tokens(smollm2_tokenizer) -> None:
    """The request's min_tokens reaches the detokenizer: a stop string in the text of the
    first min_tokens tokens does not end the output (vLLM's rule)."""
    tok = smollm2_tokenizer
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    out, stopped = _run(tok, ids, None, stop=["alpha"], min_tokens=2)
    assert list(out.token_ids) == ids and out.finish_reason is None and stopped == []
    out, stopped = _run(tok, ids, None, stop=["alpha"])
    assert list(out.token_ids) == ids[:1] and out.stop_reason == "alpha" and stopped == ["r"]
