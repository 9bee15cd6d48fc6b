"""How a model's layers share the paged KV cache: its KV cache groups.

Layers that attend alike share block tables. A model whose layers all use full attention (or
all one sliding window) has one group, and every layer reads the request's one block table.
A model that interleaves sliding-window layers with full ones (Gemma 3) has a group per
attention type, each with its own block table per request: a sliding group needs only the
blocks its window still sees, a full group every block.

All groups draw block ids from one pool, so capacity is shared and counted in blocks. For a
block id to mean the same amount of memory in every group, groups have the same number of
layers (`group_size`, the smallest per-type layer count; a type whose count it does not divide
ends in a shorter, padded group). The cache has `group_size` tensors ("layer slots"), and
layer j of every group keeps its K/V in slot j's tensor: block id b of group g is page b of
each of those tensors, as seen by g's layers. One block id is `group_size` layer pages.

Torch-free: the scheduler counts blocks by this, the worker lays out its tensors by it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroup:
    # Model layers of the group, in slot order: layers[j] keeps its K/V in slot j's tensor.
    layers: tuple[int, ...]
    # None: full attention. w: a query at position p sees keys (p - w, p], so the blocks
    # before that never need to be kept for it.
    sliding_window: int | None = None


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    # Layer slots (cache tensors); one block id is a page of each.
    group_size: int

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def is_single_full(self) -> bool:
        """Today's layout: one group, full attention, nothing ever freed early."""
        return len(self.groups) == 1 and self.groups[0].sliding_window is None

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks never handed out: with a sliding group, the null block (id 0) that stands in
        a table for a block freed out of the window."""
        return 0 if all(g.sliding_window is None for g in self.groups) else 1

    def layer_placement(self, num_layers: int) -> list[tuple[int, int]]:
        """(group, slot) of each model layer."""
        placement: list[tuple[int, int] | None] = [None] * num_layers
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layers):
                placement[layer] = (g, slot)
        assert all(p is not None for p in placement), "a layer belongs to no KV cache group"
        return placement  # type: ignore[return-value]

    def blocks_per_sequence(self, num_tokens: int, block_size: int, step_tokens: int = 1) -> int:
        """Most blocks one sequence of `num_tokens` tokens holds at once, over all groups, when
        a step computes up to `step_tokens` tokens: a sliding group holds only the blocks of its
        window and the step's tokens."""
        full = cdiv(num_tokens, block_size)
        total = 0
        for group in self.groups:
            w = group.sliding_window
            if w is None:
                total += full
            else:
                # w - 1 keys before the step's first query, then the step's tokens: a span of
                # s tokens touches at most cdiv(s - 1, block_size) + 1 blocks.
                span = w - 1 + step_tokens
                total += min(full, cdiv(span - 1, block_size) + 1)
        return total

    def token_capacity(self, num_blocks: int, block_size: int) -> int:
        """Tokens the cache surely holds however sequences are split: every group counted as
        growing with its tokens (a sliding group holds fewer, so this is a lower bound)."""
        return (num_blocks - self.num_reserved_blocks) * block_size // len(self.groups)


def kv_cache_layout(sliding_windows: Sequence[int | None], num_layers: int,
                    max_model_len: int | None = None) -> KVCacheLayout:
    """The groups of a model with these per-layer windows (None = full attention; an empty
    sequence = every layer full). A window of at least `max_model_len` never hides a key, so
    its layers count as full attention. Full-attention groups come first."""
    windows = list(sliding_windows) or [None] * num_layers
    assert len(windows) == num_layers, "one window per layer"
    if max_model_len is not None:
        windows = [None if w is not None and w >= max_model_len else w for w in windows]
    by_type: dict[int | None, list[int]] = {}
    for layer, w in enumerate(windows):
        by_type.setdefault(w, []).append(layer)
    if len(by_type) == 1:
        (w, layers), = by_type.items()
        return KVCacheLayout((KVCacheGroup(tuple(layers), w),), num_layers)
    size = min(len(layers) for layers in by_type.values())
    groups = []
    for w in sorted(by_type, key=lambda w: (w is not None, w or 0)):
        layers = by_type[w]
        for start in range(0, len(layers), size):
            groups.append(KVCacheGroup(tuple(layers[start:start + size]), w))
    return KVCacheLayout(tuple(groups), size)


def full_attention_layout(num_layers: int) -> KVCacheLayout:
    """One full-attention group of every layer: today's layout, whatever the layers' windows
    (their masks still apply; only the early freeing of blocks is off)."""
    return KVCacheLayout((KVCacheGroup(tuple(range(num_layers)), None),), num_layers)
