"""Incremental (streaming) detokenization with stop strings.

Why this is not just ``tokenizer.decode(all_ids)`` every step: that is O(n) per
token, O(n^2) per request. Instead we keep a small window of recent token ids
and use two offsets into it:

* ``prefix_offset``: start of the window we decode. A few tokens of context are
  needed because decoders are not position-free: SentencePiece/Metaspace
  decoders strip the leading space of the *first* token they see, and
  byte-level BPE needs the preceding bytes of a multi-byte character.
* ``read_offset``: the end of the text that has already been emitted.

Each step we decode ``tokens[prefix:]`` and ``tokens[prefix:read]``; the new
text is the difference. If the new text ends in U+FFFD the last token only
carried part of a UTF-8 character, so we emit nothing and wait for the next
token (the offsets stay put, so the bytes are re-decoded together later).

``spaces_between_special_tokens``: transformers 5 ignores this kwarg for every
tokenizer backend, so we implement it ourselves the way the old "slow"
tokenizers did for special tokens: the output is split into runs at every
rendered special added token, each run is decoded on its own, and the pieces
(runs and special-token strings) are joined with a single space. Added tokens
not flagged special (Gemma's "\n\n" and whitespace runs) are ordinary text:
splitting at them would put spaces inside the text itself. :func:`detokenize_ids` is the whole-sequence
reference for exactly the text the incremental detokenizer produces.

Known, deliberate divergence: a byte-fallback decoder (``<0xE4>`` tokens)
turns a *whole* run of byte tokens into U+FFFD when any character in it is
cut short (e.g. a special token or the end of output lands mid-character).
Streaming has already shown the complete characters of that run and keeps
them; only the cut character becomes U+FFFD.

``clean_up_tokenization_spaces`` is always off: that clean-up rewrites text
across token boundaries (" ." -> "."), which streaming cannot reproduce, and
transformers already disables it for BPE models.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

# How many trailing prompt tokens seed the decode window. Enough to recover a
# leading space and the start of a multi-byte character (at most 4 bytes).
_PROMPT_CONTEXT_TOKENS = 6
# Drop already-consumed window tokens once this many pile up, so memory for the
# window stays bounded however long the output grows.
_WINDOW_TRIM_THRESHOLD = 64
_REPLACEMENT_CHAR = "\ufffd"
_METASPACE = "\u2581"  # "▁", SentencePiece's space marker


@dataclass(frozen=True)
class _TokenizerInfo:
    """Per-tokenizer facts we need on every token; computed once and cached."""

    vocab_len: int  # len(tokenizer) when computed; a change invalidates the cache
    special_ids: frozenset[int]  # dropped when skip_special_tokens=True
    # id -> content of the added tokens flagged special: the pieces spaces_between_special_
    # tokens separates. Plain added tokens (Gemma's whitespace runs, "\n\n") decode as text.
    added_tokens: dict[int, str] = field(default_factory=dict)
    # The fast tokenizer's Rust decode, called directly (_backend_decode); None: decode().
    backend_decode: Any = None


_INFO_CACHE: "weakref.WeakKeyDictionary[Any, _TokenizerInfo]" = weakref.WeakKeyDictionary()


def _tokenizer_info(tokenizer: Any) -> _TokenizerInfo:
    vocab_len = len(tokenizer)
    try:
        cached = _INFO_CACHE.get(tokenizer)
    except TypeError:  # unhashable / not weak-referenceable tokenizer object
        cached = None
    if cached is not None and cached.vocab_len == vocab_len:
        return cached

    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    added_tokens = {int(i): str(getattr(t, "content", t)) for i, t in added.items()
                    if getattr(t, "special", True)}
    # For fast tokenizers the backend skips exactly the added tokens flagged
    # special; the Python backend skips ``all_special_ids``. Use the flag when
    # it is available so we agree with the backend's decode().
    special = {int(i) for i, t in added.items() if getattr(t, "special", False)}
    if not getattr(tokenizer, "is_fast", False):
        special |= set(getattr(tokenizer, "all_special_ids", []) or [])
    info = _TokenizerInfo(vocab_len, frozenset(special), added_tokens,
                          _backend_decode(tokenizer))
    try:
        _INFO_CACHE[tokenizer] = info
    except TypeError:
        pass
    return info


def _backend_decode(tokenizer: Any) -> Any:
    """The Rust `tokenizers.Tokenizer.decode` behind a fast tokenizer, or None. With
    skip_special_tokens and clean-up off, transformers' decode is that call wrapped in
    argument handling that cost ~3 of its ~4 us per call (and a streamed token takes two
    calls): at a batch of 256 a millisecond and a half of host time per step."""
    backend = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) \
        else None
    decode = getattr(backend, "decode", None)
    return decode if callable(decode) else None


def _decode(tokenizer: Any, ids: list[int], backend: Any = None) -> str:
    # Skipping is done by the caller (ids are pre-filtered), so the backend is
    # always asked to render everything it is given. `backend`: _TokenizerInfo.backend_decode.
    if not ids:
        return ""
    if backend is not None:
        return backend(ids, skip_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def detokenize_ids(
    tokenizer: Any,
    ids: list[int],
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
) -> str:
    """Decode a whole id sequence (prompt text, final text, tests' reference)."""
    info = _tokenizer_info(tokenizer)
    kept = [i for i in ids if not (skip_special_tokens and i in info.special_ids)]
    if not spaces_between_special_tokens or not any(i in info.added_tokens for i in kept):
        return _decode(tokenizer, kept, info.backend_decode)
    pieces: list[str] = []
    run: list[int] = []
    for tid in kept:
        if tid in info.added_tokens:
            if run:
                pieces.append(_decode(tokenizer, run, info.backend_decode))
                run = []
            pieces.append(info.added_tokens[tid])
        else:
            run.append(tid)
    if run:
        pieces.append(_decode(tokenizer, run, info.backend_decode))
    return " ".join(pieces)


def decode_token(tokenizer: Any, token_id: int) -> str:
    """Text of one token as shown in OpenAI-style logprobs.

    Decoding a lone SentencePiece token strips its leading space (the decoder
    treats it as the start of the text), so we put the space back when the raw
    token string starts with the ``▁`` marker. A token holding only part of a
    UTF-8 character decodes to U+FFFD, which is what we return.
    """
    text = tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    raw = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(raw, str) and raw.startswith(_METASPACE) and not text.startswith(" "):
        text = " " + text
    return text


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, one step at a time.

    ``output_text`` is the (stop-truncated) text so far; ``get_next_output_text``
    hands out what a streaming client may see.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        stream_holdback: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop: list[str] = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stream_holdback = stream_holdback
        # Stop strings are not looked for in the text of the first min_tokens tokens (vLLM's
        # rule; a match may still start there and end later).
        self.min_tokens = max(0, min_tokens)

        self.output_text: str = ""
        self.output_token_ids: list[int] = []
        self.stop_reason: str | None = None  # the stop string that ended output

        self._info = _tokenizer_info(tokenizer)
        # Added tokens are rendered as separate space-joined pieces only when
        # asked to; otherwise they flow through the normal decode window.
        self._split_runs = spaces_between_special_tokens
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        # Chars a streaming client must not see yet: the longest tail that
        # could still grow into a stop string. Including the stop string in
        # the output makes a partial prefix harmless, so no holdback then.
        self._holdback = (
            self._max_stop_len - 1
            if stream_holdback and self.stop and not include_stop_str_in_output
            else 0
        )
        self._stream_offset = 0  # chars of output_text already returned as deltas
        self._pieces = 0  # pieces (runs / added tokens) rendered, for the joiner

        # Decode window over the current run of ordinary tokens.
        self._tokens: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""
        self._run_started = False  # has the current run emitted its joiner yet?
        self._seed_context(prompt_token_ids)

    # ------------------------------------------------------------------ setup

    def _seed_context(self, prompt_token_ids: list[int]) -> None:
        """Prime the window with the prompt's tail so the first output token
        decodes as it would in the middle of the text (leading space, bytes)."""
        tail = [t for t in prompt_token_ids[-4 * _PROMPT_CONTEXT_TOKENS :] if self._renders(t)]
        if self._split_runs:
            # A new run begins after the last added token; earlier tokens are
            # in another piece and must not influence this one.
            for i in range(len(tail) - 1, -1, -1):
                if tail[i] in self._info.added_tokens:
                    tail = tail[i + 1 :]
                    break
        ctx = tail[-_PROMPT_CONTEXT_TOKENS:]
        # Context must start and end on character boundaries, otherwise the
        # prefix text contains U+FFFD that the extended text would not (or
        # vice versa) and the text difference would be wrong.
        while ctx and self._text(ctx).endswith(_REPLACEMENT_CHAR):
            ctx.pop()
        while ctx and self._text(ctx).startswith(_REPLACEMENT_CHAR):
            ctx.pop(0)
        self._tokens = ctx
        self._prefix_offset = 0
        self._read_offset = len(ctx)
        self._prefix_text = self._text(ctx)

    def _text(self, ids: list[int]) -> str:
        return _decode(self.tokenizer, ids, self._info.backend_decode)

    def _renders(self, token_id: int) -> bool:
        return not (self.skip_special_tokens and token_id in self._info.special_ids)

    # --------------------------------------------------------------- decoding

    def _push_token(self, token_id: int) -> str:
        """Add one rendered token; return the text that became final."""
        if self._split_runs and token_id in self._info.added_tokens:
            text = self._flush_run()
            sep = " " if self._pieces else ""
            self._pieces += 1
            # The next ordinary token starts a fresh, context-free run.
            self._tokens, self._prefix_offset, self._read_offset = [], 0, 0
            self._prefix_text = ""
            self._run_started = False
            return text + sep + self._info.added_tokens[token_id]

        sep = ""
        if not self._run_started:
            self._run_started = True
            if self._split_runs:
                sep = " " if self._pieces else ""
                self._pieces += 1
        self._tokens.append(token_id)
        new_text = self._text(self._tokens[self._prefix_offset :])
        if new_text.endswith(_REPLACEMENT_CHAR) or len(new_text) <= len(self._prefix_text):
            # Incomplete UTF-8 character (or nothing visible yet): wait.
            return sep
        delta = new_text[len(self._prefix_text) :]
        self._advance()
        return sep + delta

    def _advance(self) -> None:
        """Everything up to the end of the window is emitted: slide it."""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        if self._prefix_offset >= _WINDOW_TRIM_THRESHOLD:
            del self._tokens[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self._prefix_text = self._text(self._tokens[self._prefix_offset : self._read_offset])

    def _flush_run(self) -> str:
        """Force out text held back for an incomplete character (the run or
        the output ended), U+FFFD included, exactly as a full decode shows it."""
        if self._read_offset >= len(self._tokens):
            return ""
        new_text = self._text(self._tokens[self._prefix_offset :])
        delta = new_text[len(self._prefix_text) :]
        self._advance()
        return delta

    # ------------------------------------------------------------ stop check

    def _append_and_check_stop(self, text: str) -> str | None:
        if not text:
            return None
        start = len(self.output_text)
        self.output_text += text
        if not self.stop or len(self.output_token_ids) <= self.min_tokens:
            return None
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stop:
            # Only matches that end inside the new text are new; they can
            # start at most len(s)-1 chars before it.
            idx = self.output_text.find(s, max(0, start - len(s) + 1))
            if idx < 0:
                continue
            cand = (idx + len(s), idx, s)
            # The match that completes first wins (ties: the longer one): it is
            # the one token-by-token streaming would have seen first, so the
            # result does not depend on how tokens were batched into updates.
            if best is None or cand[:2] < best[:2]:
                best = cand
        if best is None:
            return None
        end, idx, s = best
        self.output_text = self.output_text[: end if self.include_stop_str_in_output else idx]
        self.stop_reason = s
        return s

    # ----------------------------------------------------------------- public

    @property
    def stopped(self) -> bool:
        """True once a stop string has ended the output."""
        return self.stop_reason is not None

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append tokens; return the stop string if one matched, else None.

        ``stop_terminated``: the last id is the EOS / stop token that finished
        the request. It is recorded in ``output_token_ids`` but not rendered
        (a stop token is a control signal, not text) unless
        ``include_stop_str_in_output`` asks for stops to be shown and it is not
        a special token being skipped. The request is over, so any text held
        back for an incomplete character is flushed too.

        With stop strings the tokens are checked one at a time, and
        ``output_token_ids`` ends at the token that completed the match: a step
        that brought several tokens (speculative decoding's kept drafts) ends
        the output where one token a step would have, and the caller keeps only
        the ids taken (``len(output_token_ids)`` before and after).
        """
        if self.stopped:
            return None  # output already ended; later tokens are not taken
        last = len(new_token_ids) - 1
        parts: list[str] = []
        for i, token_id in enumerate(new_token_ids):
            self.output_token_ids.append(token_id)
            ends_request = stop_terminated and i == last
            if self._renders(token_id) and not (ends_request
                                                and not self.include_stop_str_in_output):
                parts.append(self._push_token(token_id))
            if ends_request:
                parts.append(self._flush_run())
            if self.stop:
                matched = self._append_and_check_stop("".join(parts))
                parts.clear()
                if matched is not None:
                    return matched
        if parts:  # no stop strings: the text only grows
            self.output_text += "".join(parts)
        return None

    def flush(self) -> str | None:
        """Emit text held for an incomplete trailing character (call when the
        request ends for a reason other than a stop token). Returns a stop
        string if the flushed text completed one."""
        if self.stopped:
            return None
        return self._append_and_check_stop(self._flush_run())

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text for the client: the whole text so far, or (delta=True) only what
        previous delta calls have not returned. While unfinished, the last
        (longest stop - 1) characters are held back so a stop string arriving
        across several tokens is never partly streamed."""
        if finished:
            self.flush()
        if finished or self.stopped:
            length = len(self.output_text)
        else:
            length = max(0, len(self.output_text) - self._holdback)
        if not delta:
            return self.output_text[:length]
        if length <= self._stream_offset:
            return ""
        out = self.output_text[self._stream_offset : length]
        self._stream_offset = length
        return out
