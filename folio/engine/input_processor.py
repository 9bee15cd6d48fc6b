"""Front-end validation and tokenization: nothing reaches the engine core that it cannot serve."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from folio.pooling_params import PoolingParams
from folio.sampling_params import SamplingParams

PromptType = str | dict | list

# No tokenizer here spends fewer than one token per this many characters of ordinary text;
# a prompt whose first max_model_len * this characters already fill the context is too long,
# whatever follows, so it need not be tokenized whole (a 30 MB prompt takes 40 s to encode).
_CHARS_PER_TOKEN_BOUND = 16


def encode_prompt(tokenizer: Any, text: str, max_model_len: int, *,
                  add_special_tokens: bool = True, truncating: bool = False) -> list[int]:
    """Tokenize a text prompt; raise ValueError (field "prompt") as soon as it is certain not
    to fit the context. With truncation the whole text is needed (the end is kept)."""
    head_chars = max_model_len * _CHARS_PER_TOKEN_BOUND
    if not truncating and len(text) > head_chars:
        head = tokenizer.encode(text[:head_chars], add_special_tokens=add_special_tokens)
        # Cutting the text can merge at most a token or two at the cut.
        if len(head) > max_model_len + 2:
            raise ValueError(f"prompt is longer than max_model_len={max_model_len} tokens "
                             f"(it has {len(text)} characters)")
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def check_token_ids(ids: list, vocab_size: int) -> None:
    """ValueError (field prompt_token_ids) unless every id is an int (not a bool) in
    [0, vocab_size). The common case is three passes in C (types, min, max); only a bad list is
    scanned in Python, to name its first bad ids."""
    if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size):
        return
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)
           or not 0 <= t < vocab_size]
    raise ValueError(f"prompt_token_ids has ids outside the vocabulary [0, {vocab_size}): "
                     f"{bad[:5]}")


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    # Segment ids (a cross-encoder's query/document pair on a BERT-style tokenizer).
    token_type_ids: list[int] | None = None


class InputProcessor:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedPrompt:
        text, ids = self._tokenize(prompt, params.truncate_prompt_tokens is not None)
        if not ids:
            raise ValueError("prompt must not be empty")
        if params.truncate_prompt_tokens is not None:
            keep = (self.max_model_len if params.truncate_prompt_tokens == -1
                    else params.truncate_prompt_tokens)
            ids = ids[-keep:]  # keep the end of the prompt, as vLLM does
        # Length before contents: checking a huge id list costs time in proportion to it.
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, which leaves no room to "
                             f"generate within max_model_len={self.max_model_len}")
        check_token_ids(ids, self.vocab_size)
        params.update_from_tokenizer(self.tokenizer, self.vocab_size)
        return ProcessedPrompt(text, ids)

    def process_pooling(self, prompt: PromptType, params: PoolingParams,
                        pair: str | None = None) -> ProcessedPrompt:
        """A pooling request's input: a prompt as for generation, or (cross-encoder scoring) a
        text pair tokenized together as the model's tokenizer joins pairs (with segment ids
        where it makes them). It may fill the whole context. `truncate_prompt_tokens` keeps
        the first k tokens, as the tokenizer truncates (special tokens kept) and
        sentence-transformers does; -1 = max_model_len. Without it a longer input is an
        error naming the field to set."""
        # An empty text is refused even where the tokenizer would add special tokens to it
        # (OpenAI's embeddings API refuses it too): its vector would mean nothing.
        if (isinstance(prompt, str) and not prompt) or (isinstance(prompt, dict) and
                                                        prompt.get("prompt") == ""):
            raise ValueError("prompt must not be empty")
        if pair is not None and not pair:
            raise ValueError("prompt pair (the document) must not be empty")
        limit = self.max_model_len
        keep = params.truncate_prompt_tokens
        if keep is not None:
            keep = limit if keep == -1 else keep
            if keep > limit:
                raise ValueError(f"truncate_prompt_tokens ({keep}) is larger than the model's "
                                 f"maximum input length ({limit} tokens, max_model_len)")
        types = None
        if pair is not None or (isinstance(prompt, str) and keep is not None):
            text = prompt if isinstance(prompt, str) else None
            if text is None:
                raise ValueError("prompt must be a string when it is scored against a pair")
            if keep is None:
                self._check_text_bound(text + (pair or ""))
            else:
                # Only the first `keep` tokens survive, and they come from at most this many
                # characters of each text: a huge text is not tokenized whole.
                head = (keep + 8) * _CHARS_PER_TOKEN_BOUND
                text, pair = text[:head], None if pair is None else pair[:head]
            enc = self.tokenizer(text, pair, truncation=keep is not None,
                                 max_length=keep)
            ids = list(enc["input_ids"])
            if pair is not None and "token_type_ids" in enc:
                types = list(enc["token_type_ids"])
            display = prompt if pair is None else None
        else:
            display, ids = self._tokenize(prompt, False)
            if keep is not None:
                ids = ids[:keep]
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) > limit:
            raise ValueError(f"prompt has {len(ids)} tokens, more than the model's maximum "
                             f"input length of {limit} (max_model_len); set "
                             "truncate_prompt_tokens to cut it")
        check_token_ids(ids, self.vocab_size)
        if types is not None and not any(types):
            types = None   # all zeros: the model's default
        return ProcessedPrompt(display, ids, types)

    def tokenize_pooling_texts(self, texts: list[str], keep: int | None) -> list[list[int]]:
        """Many pooling texts in one batched tokenizer call (the fast tokenizer encodes a batch
        on several threads; one call per text cost more than the model on a GPU), as
        process_pooling tokenizes one: `keep` = its truncate_prompt_tokens resolved (None: no
        truncation). Texts that cannot fit are left for process_pooling to refuse: an empty
        list in their place."""
        limit = self.max_model_len
        if keep is not None:
            keep = limit if keep == -1 else keep
        head = None if keep is None else (keep + 8) * _CHARS_PER_TOKEN_BOUND
        bound = limit * _CHARS_PER_TOKEN_BOUND
        batch = [t if head is None else t[:head] for t in texts]
        fits = [keep is not None or len(t) <= bound for t in batch]
        # ids only: the masks and segment ids transformers builds per text by default held
        # the GIL for a third of the call
        encoded = self.tokenizer([t for t, ok in zip(batch, fits) if ok],
                                 truncation=keep is not None, max_length=keep,
                                 return_attention_mask=False,
                                 return_token_type_ids=False)["input_ids"]
        found = iter(encoded)
        return [list(next(found)) if ok else [] for ok in fits]

    def _check_text_bound(self, text: str) -> None:
        """A text that cannot fit, refused without tokenizing all of it."""
        encode_prompt(self.tokenizer, text, self.max_model_len)

    def _encode(self, text: str, truncating: bool) -> list[int]:
        return encode_prompt(self.tokenizer, text, self.max_model_len, truncating=truncating)

    def _tokenize(self, prompt: PromptType, truncating: bool) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._encode(prompt, truncating)
        if isinstance(prompt, dict):
            if prompt.get("multi_modal_data"):
                # never dropped silently: the answer would ignore the image (RequestPreparer
                # turns images into token ids and ImageInputData before this point)
                raise ValueError("multi_modal_data: images are taken by the engine's request "
                                 "preparation, not by the input processor alone")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list):
                    raise ValueError("prompt_token_ids must be a list of ints")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self._encode(prompt["prompt"], truncating)
            raise ValueError("prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict with "
                         f"'prompt_token_ids', got {type(prompt).__name__}")
