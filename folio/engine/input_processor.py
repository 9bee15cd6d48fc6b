"""Front-end validation and tokenization: nothing reaches the engine core that it cannot serve."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from folio.sampling_params import SamplingParams

PromptType = str | dict | list


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
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)
               or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids has ids outside the vocabulary "
                             f"[0, {self.vocab_size}): {bad[:5]}")
        if params.truncate_prompt_tokens is not None:
            keep = (self.max_model_len if params.truncate_prompt_tokens == -1
                    else params.truncate_prompt_tokens)
            ids = ids[-keep:]  # keep the end of the prompt, as vLLM does
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, which leaves no room to "
                             f"generate within max_model_len={self.max_model_len}")
        params.update_from_tokenizer(self.tokenizer, self.vocab_size)
        return ProcessedPrompt(text, ids)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list):
                    raise ValueError("prompt_token_ids must be a list of ints")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict with "
                         f"'prompt_token_ids', got {type(prompt).__name__}")
