"""The disk KV tier's files (--kv-disk-path DIR --kv-disk-size GiB), on the worker's side:
a block's K/V for every layer as one file named by its block hash, in a directory of its own
for the model, dtype and cache layout (another model, dtype or layout never reads them).

A file is a header — magic, format version, the block hash, the payload's length and its
SHA-256 — then the payload: each layer's host slot bytes in layer order. A read checks the
size, the header and the checksum before a byte reaches the host pool; a file that fails is a
miss (logged, deleted), never a crash or a wrong answer. Files are written to a temporary
name and renamed, so a crash never leaves a half-written block under a real name.
"""
from __future__ import annotations

import hashlib
import logging
import os
import struct

import torch

from folio.worker.host_kv_pool import HostKVPool

logger = logging.getLogger(__name__)

_MAGIC = b"FOLIOKV"
_VERSION = 1
_HEADER = struct.Struct("<7sB32sQ32s")    # magic, version, block hash, payload bytes, sha256


def namespace_of(*parts: object) -> str:
    """The directory name for blocks of one model, dtype and layout."""
    return hashlib.sha256(repr(parts).encode("utf-8")).hexdigest()[:32]


class DiskKVStore:
    def __init__(self, root: str, namespace: str, pool: HostKVPool) -> None:
        self.dir = os.path.join(root, namespace)
        os.makedirs(self.dir, exist_ok=True)
        self.pool = pool
        self.payload_bytes = sum(host[0].numel() * host.element_size() for host in pool.host)

    def _path(self, block_hash: bytes) -> str:
        return os.path.join(self.dir, block_hash.hex())

    def existing(self) -> list[bytes]:
        """The block hashes with a file here, least recently written first."""
        found = []
        for name in os.listdir(self.dir):
            if len(name) != 64:
                continue      # temporaries and strangers
            try:
                block_hash = bytes.fromhex(name)
                found.append((os.path.getmtime(os.path.join(self.dir, name)), block_hash))
            except (ValueError, OSError):
                continue
        return [block_hash for _, block_hash in sorted(found)]

    def payload_of(self, slot: int) -> bytes:
        """A copy of host slot `slot`'s bytes, every layer's in layer order."""
        return b"".join(host[slot].view(torch.uint8).numpy().tobytes()
                        for host in self.pool.host)

    def write(self, block_hash: bytes, payload: bytes) -> None:
        """A block's file from its payload (payload_of)."""
        header = _HEADER.pack(_MAGIC, _VERSION, block_hash, len(payload),
                              hashlib.sha256(payload).digest())
        path = self._path(block_hash)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as exc:    # a full disk loses the block, as without the tier
            logger.warning("disk KV tier: could not write block %s: %s", block_hash.hex()[:16],
                           exc)
            try:
                os.unlink(tmp)
            except OSError:
                pass      # never created: nothing to clean up

    def read(self, block_hash: bytes, slot: int) -> bool:
        """The block's file into host slot `slot`; False (and the file deleted) when it is
        missing, short, or fails its header or checksum."""
        path = self._path(block_hash)
        try:
            with open(path, "rb") as f:
                data = bytearray(f.read(_HEADER.size + self.payload_bytes + 1))
        except OSError as exc:
            logger.warning("disk KV tier: block %s unreadable (%s): computed instead",
                           block_hash.hex()[:16], exc)
            return False
        problem = None
        if len(data) != _HEADER.size + self.payload_bytes:
            problem = f"{len(data)} bytes, expected {_HEADER.size + self.payload_bytes}"
        else:
            magic, version, stored_hash, length, digest = _HEADER.unpack_from(data)
            payload = memoryview(data)[_HEADER.size:]
            if magic != _MAGIC or version != _VERSION:
                problem = "not a folio KV block file"
            elif stored_hash != block_hash or length != self.payload_bytes:
                problem = "header does not match"
            elif hashlib.sha256(payload).digest() != digest:
                problem = "checksum mismatch"
        if problem is not None:
            logger.warning("disk KV tier: bad block file %s (%s): computed instead", path,
                           problem)
            self.delete(block_hash)
            return False
        offset = _HEADER.size
        for host in self.pool.host:
            target = host[slot].view(torch.uint8).view(-1)
            n = target.numel()
            target.copy_(torch.frombuffer(data, dtype=torch.uint8, count=n, offset=offset))
            offset += n
        return True

    def delete(self, block_hash: bytes) -> None:
        try:
            os.unlink(self._path(block_hash))
        except OSError:
            pass      # already gone: what deleting wants
