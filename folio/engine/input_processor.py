"""Front-end validation and tokenization: nothing reaches the engine core that it cannot serve."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


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
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)
               or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids has ids outside the vocabulary "
                             f"[0, {self.vocab_size}): {bad[:5]}")
        params.update_from_tokenizer(self.tokenizer, self.vocab_size)
        return ProcessedPrompt(text, ids)

    def _encode(self, text: str, truncating: bool) -> list[int]:
        return encode_prompt(self.tokenizer, text, self.max_model_len, truncating=truncating)

    def _tokenize(self, prompt: PromptType, truncating: bool) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._encode(prompt, truncating)
        if isinstance(prompt, dict):
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
