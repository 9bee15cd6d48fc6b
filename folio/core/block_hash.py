"""Content hashes of KV cache blocks.

A block's hash covers its parent's hash, its token ids and extra keys, so equal hashes mean
equal prefixes. SHA-256 rather than Python's hash(): a collision would hand one tenant another
tenant's KV cache, so it must not be craftable.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Any, Sequence

BlockHash = bytes

_ROOT = b"folio-block-hash-v1"


def _encode_extra(extra_keys: tuple[Any, ...]) -> bytes:
    # repr is unambiguous for the str/int/None/tuple keys we use (salt, adapter id, media hashes).
    return repr(extra_keys).encode("utf-8") if any(k is not None for k in extra_keys) else b""


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple[Any, ...] = ()) -> BlockHash:
    h = hashlib.sha256()
    h.update(parent if parent is not None else _ROOT)
    h.update(array("q", token_ids).tobytes())
    extra = _encode_extra(extra_keys)
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    return h.digest()
