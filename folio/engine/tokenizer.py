"""Loading the tokenizer that goes with a model source."""
from __future__ import annotations

from typing import Any

from folio.model.discovery import ModelSource


def load_tokenizer(source: ModelSource, tokenizer: str | None = None,
                   revision: str | None = None) -> Any:
    from transformers import AutoTokenizer
    if tokenizer is not None:
        try:
            return AutoTokenizer.from_pretrained(tokenizer, revision=revision)
        except Exception as exc:
            raise ValueError(f"could not load tokenizer {tokenizer!r}: {exc}") from exc
    if source.kind == "gguf":
        from folio.model.gguf_metadata import load_gguf_tokenizer
        return load_gguf_tokenizer(source.path)
    try:
        return AutoTokenizer.from_pretrained(source.path)
    except Exception as exc:
        raise ValueError(f"could not load the tokenizer in {source.path!r}: {exc}") from exc


def eos_token_ids(tokenizer: Any, hf_config: Any, generation_config: Any | None) -> tuple[int, ...]:
    """Every id that ends generation: the tokenizer's EOS, the model config's, and the
    generation config's (Llama 3 lists several there)."""
    ids: list[int] = []
    for source in (getattr(generation_config, "eos_token_id", None),
                   getattr(hf_config, "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        for value in (source if isinstance(source, (list, tuple)) else [source]):
            if value is not None and value not in ids:
                ids.append(int(value))
    return tuple(ids)
