"""Where folio keeps what it derives from model files (converted checkpoints, tokenizers,
random-weight models): $FOLIO_CACHE_DIR, else ~/.cache/folio. Its own module so that the
readers below the default model (gguf_metadata) can use it without importing it."""
from __future__ import annotations

import os


def folio_cache_dir() -> str:
    """$FOLIO_CACHE_DIR, else ~/.cache/folio."""
    env = os.environ.get("FOLIO_CACHE_DIR")
    return os.path.abspath(os.path.expanduser(env)) if env else os.path.expanduser("~/.cache/folio")
