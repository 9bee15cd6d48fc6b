from folio.model.attention.backend import AttentionBackend, AttentionMetadata
from folio.model.attention.selector import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
