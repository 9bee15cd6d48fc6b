import pytest

from folio.sampling_params import RequestOutputKind, SamplingParams, SamplingType


# --------------------------------------------------------------------------
# Defaults and normalisation
# --------------------------------------------------------------------------


def test_defaults_match_vllm():
    p = SamplingParams()
    assert p.n == 1
    assert p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0 and p.min_p == 0.0
    assert p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
    assert p.repetition_penalty == 1.0
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.stop == [] and p.stop_token_ids == []
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.detokenize and p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.logit_bias is None and p.allowed_token_ids is None and p.bad_words is None
    assert p.truncate_prompt_tokens is None
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.bad_words_token_ids == []
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy


def test_output_kind_enum_members():
    assert {k.name for k in RequestOutputKind} == {"CUMULATIVE", "DELTA", "FINAL_ONLY"}
    assert SamplingParams(output_kind=RequestOutputKind.DELTA).output_kind is RequestOutputKind.DELTA


def test_stop_string_normalised_to_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_stop_token_ids_normalised_to_list():
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []


def test_top_k_minus_one_means_disabled():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5


def test_logit_bias_string_keys_and_range():
    p = SamplingParams(logit_bias={"12": 5, 7: 100.0, " 3": -100})
    assert p.logit_bias == {12: 5.0, 7: 100.0, 3: -100.0}
    assert all(isinstance(k, int) for k in p.logit_bias)
    # OpenAI's range: outside it is an error naming the field, not a silent clamp.
    for value in (100.5, -250.0):
        with pytest.raises(ValueError, match=r"^logit_bias"):
            SamplingParams(logit_bias={7: value})


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**30])
def test_seed_outside_int64_is_refused(seed):
    with pytest.raises(ValueError, match=r"^seed"):
        SamplingParams(seed=seed, temperature=1.0)


def test_seed_int64_bounds_accepted():
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_int_accepted_for_float_fields():
    p = SamplingParams(temperature=1, top_p=1, presence_penalty=1)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)


def test_none_max_tokens_allowed():
    p = SamplingParams(max_tokens=None, min_tokens=1000)
    assert p.max_tokens is None


def test_greedy_resets_filters_and_sampling_type():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert p.is_greedy and p.sampling_type is SamplingType.GREEDY
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED


def test_logprobs_minus_one_allowed():
    p = SamplingParams(logprobs=-1, prompt_logprobs=-1)
    assert p.logprobs == -1 and p.prompt_logprobs == -1


def test_truncate_prompt_tokens_values():
    assert SamplingParams(truncate_prompt_tokens=-1).truncate_prompt_tokens == -1
    assert SamplingParams(truncate_prompt_tokens=8).truncate_prompt_tokens == 8


def test_output_text_buffer_length():
    assert SamplingParams().output_text_buffer_length == 0
    assert SamplingParams(stop=["ab", "wxyz"]).output_text_buffer_length == 3
    assert SamplingParams(stop=["wxyz"], include_stop_str_in_output=True).output_text_buffer_length == 0


def test_clone_is_deep():
    p = SamplingParams(stop=["x"], logit_bias={1: 2.0}, bad_words=["foo"])
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y")
    q.logit_bias[5] = 1.0
    q.bad_words_token_ids.append([1])
    assert p.stop == ["x"] and p.logit_bias == {1: 2.0} and p.bad_words_token_ids == []


# --------------------------------------------------------------------------
# Validation: each bad value raises ValueError naming the field
# --------------------------------------------------------------------------

BAD_VALUES = [
    ("n", 0),
    ("n", -1),
    ("n", 1.5),
    ("n", "2"),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", "0.1"),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", -3.0),
    ("frequency_penalty", None),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", "1"),
    ("temperature", -1.0),
    ("temperature", -0.001),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "hot"),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", 1.1),
    ("top_p", -0.5),
    ("top_p", "0.9"),
    ("top_k", -2),
    ("top_k", 2.0),
    ("top_k", "5"),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("min_p", [0.1]),
    ("seed", 1.5),
    ("seed", "42"),
    ("stop", [""]),
    ("stop", ""),
    ("stop", ["ok", 3]),
    ("stop", 3),
    ("stop_token_ids", [1, "2"]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", "12"),
    ("stop_token_ids", 5),
    ("ignore_eos", "yes"),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", "16"),
    ("max_tokens", 16.0),
    ("max_tokens", True),
    ("min_tokens", -1),
    ("min_tokens", "1"),
    ("min_tokens", None),
    ("logprobs", -2),
    ("logprobs", "5"),
    ("logprobs", 1.0),
    ("prompt_logprobs", -2),
    ("prompt_logprobs", "5"),
    ("detokenize", 1),
    ("skip_special_tokens", None),
    ("spaces_between_special_tokens", "no"),
    ("include_stop_str_in_output", 0),
    ("logit_bias", {"abc": 1.0}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"-3": 1.0}),
    ("logit_bias", {1: "big"}),
    ("logit_bias", {1.5: 1.0}),
    ("logit_bias", {1: float("nan")}),
    ("logit_bias", [1, 2]),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [1, -1]),
    ("allowed_token_ids", ["a"]),
    ("allowed_token_ids", 3),
    ("bad_words", [""]),
    ("bad_words", [1]),
    ("bad_words", 1),
    ("truncate_prompt_tokens", 0),
    ("truncate_prompt_tokens", -2),
    ("truncate_prompt_tokens", "8"),
    ("output_kind", "delta"),
    ("output_kind", 1),
]


@pytest.mark.parametrize("field_name,value", BAD_VALUES)
def test_invalid_value_raises_naming_field(field_name, value):
    with pytest.raises(ValueError, match=field_name):
        SamplingParams(**{field_name: value})


def test_temperature_message():
    with pytest.raises(ValueError, match=r"temperature must be non-negative, got -1.0"):
        SamplingParams(temperature=-1.0)


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5


def test_stop_requires_detokenize():
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["x"], detokenize=False)
    # Stop *token ids* need no text, so they are fine without detokenization.
    assert SamplingParams(stop_token_ids=[1], detokenize=False).stop_token_ids == [1]


def test_greedy_with_n_above_one_rejected():
    with pytest.raises(ValueError, match="n must be 1"):
        SamplingParams(temperature=0.0, n=2)


# --------------------------------------------------------------------------
# update_from_tokenizer with a real (tiny, locally built) tokenizer
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # A GPT-2 style byte-level BPE trained on a few sentences; loading it back
    # through AutoTokenizer exercises the same code path as a real model dir.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["hello world", "the quick brown fox jumps over the lazy dog", "say hello"] * 10
    tok.train_from_iterator(corpus, trainer)
    path = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def test_update_from_tokenizer_bad_words(tokenizer):
    p = SamplingParams(bad_words=["hello", "fox jumps", " hello"])
    p.update_from_tokenizer(tokenizer, len(tokenizer))
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    expected = []
    for s in [enc("hello"), enc(" hello"), enc("fox jumps"), enc(" fox jumps")]:
        if s not in expected:
            expected.append(s)
    assert p.bad_words_token_ids == expected
    # " hello" (leading space stripped) must not add duplicates.
    assert len(p.bad_words_token_ids) == len({tuple(s) for s in p.bad_words_token_ids})
    # No special tokens slipped in.
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert all(eos not in s for s in p.bad_words_token_ids)


def test_update_from_tokenizer_no_bad_words(tokenizer):
    p = SamplingParams()
    p.update_from_tokenizer(tokenizer, len(tokenizer))
    assert p.bad_words_token_ids == []


@pytest.mark.parametrize(
    "kwargs,field_name",
    [
        ({"logit_bias": {50: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [0, 50]}, "allowed_token_ids"),
        ({"stop_token_ids": [1000]}, "stop_token_ids"),
    ],
)
def test_update_from_tokenizer_rejects_out_of_vocab(tokenizer, kwargs, field_name):
    # vocab_size is the model's vocab, which is what the ids must index.
    p = SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=field_name):
        p.update_from_tokenizer(tokenizer, 50)
    p.update_from_tokenizer(tokenizer, 1001)  # fine for a larger vocab


def test_update_from_tokenizer_accepts_in_vocab(tokenizer):
    last = len(tokenizer) - 1
    p = SamplingParams(logit_bias={last: 1.0}, allowed_token_ids=[0, last], stop_token_ids=[5])
    p.update_from_tokenizer(tokenizer, len(tokenizer))


def test_update_from_tokenizer_bad_words_beyond_model_vocab(tokenizer):
    # A model vocab narrower than the tokenizer's must not let ids through.
    p = SamplingParams(bad_words=["hello"])
    with pytest.raises(ValueError, match="bad_words"):
        p.update_from_tokenizer(tokenizer, 10)
