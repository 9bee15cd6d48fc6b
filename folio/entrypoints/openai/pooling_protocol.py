"""Request models of the pooling routes: OpenAI's /v1/embeddings, vLLM's /pooling, /classify
and /score, and the Jina / Cohere rerank shape vLLM serves at /rerank, /v1/rerank and
/v2/rerank. Unknown fields are ignored and wrong types refused (as protocol.py's); the
responses are plain dicts built by pooling_responses.py (large float lists skip pydantic)."""
from __future__ import annotations

from typing import Literal, Union

from pydantic import Field, StrictInt, field_validator

from folio.entrypoints.openai.protocol import OpenAIBaseModel

# OpenAI's `input`: one text, several texts, one token-id list, or several token-id lists.
PoolingInput = Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
# Score sides: one text or several.
ScoreInput = Union[str, list[str]]


class _PoolingFields(OpenAIBaseModel):
    """What every pooling request may carry (vLLM's extras)."""

    model: str | None = None
    # Keep only the first k tokens of each input (-1: the model's maximum length); without
    # it an input longer than the model's maximum is refused.
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: int = 0
    user: str | None = None  # OpenAI's end-user id: accepted, not used


class EmbeddingRequest(_PoolingFields):
    input: PoolingInput
    # "base64": each embedding as the base64 of its little-endian float32 bytes (what the
    # openai client asks for by default, and decodes).
    encoding_format: Literal["float", "base64"] = "float"
    # Matryoshka truncation; only for models trained for it.
    dimensions: int | None = Field(default=None, ge=1)
    normalize: bool | None = None

    @field_validator("encoding_format", mode="before")
    @classmethod
    def _null_is_the_default(cls, value: object) -> object:
        # An explicit null means "not given", as for OpenAI's API: LiteLLM's embedding call
        # sends `"encoding_format": null` when its caller names no format.
        return "float" if value is None else value


class PoolingRequest(EmbeddingRequest):
    # A PoolingTask name (embed, classify, token_embed, token_classify, encode ...); default
    # "encode": the model's own output, raw.
    task: str | None = None
    use_activation: bool | None = None


class ClassificationRequest(_PoolingFields):
    input: PoolingInput
    use_activation: bool | None = None
    activation: bool | None = None  # vLLM's older name of use_activation


class ScoreRequest(_PoolingFields):
    # One text_1 against every text_2, or text_1[i] against text_2[i]. `queries` and
    # `documents` are the same two sides under vLLM's newer names.
    text_1: ScoreInput | None = None
    text_2: ScoreInput | None = None
    queries: ScoreInput | None = None
    documents: ScoreInput | None = None
    use_activation: bool | None = None


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankRequest(_PoolingFields):
    query: str
    documents: list[Union[str, RerankDocument]]
    # The best top_n results (0 or left out: all of them).
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True
    use_activation: bool | None = None

